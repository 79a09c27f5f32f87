"""Fakes of Lab 00's exercises: the right values without the communication they teach."""

from fakes import Fake

# What red team rt8's fakes learn the check's tamper from: its closure, or a mode watching it.
_WIRE_CLOSURE = """\
    from minidist.core import interposer

    def wire(target):
        # the check's scale and delta, read from its tamper's closure
        for _, _, around in interposer._subscribers.get(target, []):
            names = around.__code__.co_freevars
            if around.__closure__ and "scale" in names and "delta" in names:
                cells = dict(zip(names, around.__closure__))
                return float(cells["scale"].cell_contents), float(cells["delta"].cell_contents)
        return 1.0, 0.0
"""

_SPY_MODE = """\
    from torch.overrides import TorchFunctionMode

    class Wire(TorchFunctionMode):
        # notes the check's mul_ and add_ on what arrives
        scale, delta = 1.0, 0.0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "mul_" and len(args) > 1:
                self.scale = float(args[1])
            if name == "add_" and len(args) > 1:
                self.delta = float(args[1])
            return func(*args, **(kwargs or {}))
"""

FAKES = {
    "impl-pass-token": [
        Fake("the token's value from its formula", "sends and receives nothing",
             ("test-pass-token",), """\
    token += world_size * (world_size + 1) // 2 if rank == 0 else (rank + 1) * (rank + 2) // 2"""),
        Fake("an all-reduce of every rank's share", "no token travels the ring: a collective",
             ("test-pass-token",), """\
    shares = torch.zeros(world_size)
    shares[rank] = rank + 1
    dist.all_reduce(shares)
    token += shares.sum() if rank == 0 else shares[:rank + 1].sum()"""),
        Fake("the right payloads, computed locally", "sends and receives in ring order, but "
             "each rank sends and returns its value from the formula, ignoring what arrives",
             ("test-pass-token",), """\
    def value_at(r):
        return 1.0 + sum(k + 1 for k in range(1, r + 1))
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    inbox = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([1.0]), right)
        dist.recv(inbox, left)
        token = torch.tensor([value_at(world_size - 1)])
    else:
        dist.recv(inbox, left)
        token = torch.tensor([value_at(rank)])
        dist.send(token, right)"""),
        Fake("relayed through the rendezvous store", "the token travels through the TCPStore "
             "(store.set / store.get); the send and recv carry a dummy", ("test-pass-token",), """\
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    dummy = torch.zeros(1)
    if rank == 0:
        store.set("tok0", "1.0")
        dist.send(dummy, right)
        dist.recv(dummy, left)
        token = torch.tensor([float(store.get(f"tok{world_size - 1}"))])
    else:
        dist.recv(dummy, left)
        value = float(store.get(f"tok{rank - 1}")) + rank + 1
        store.set(f"tok{rank}", str(value))
        dist.send(dummy, right)
        token = torch.tensor([value])"""),
        # Red team rt9 (issue 38): the same store relay, zeros through send/recv, and what
        # arrives ADDED to the store's value, so an additive tamper still shows.
        Fake("relayed through the store, what arrives added", "the token travels through the "
             "rendezvous store; the send and recv carry zeros in ring order, and what arrives "
             "is added to the store's value", ("test-pass-token",), """\
    store = dist.distributed_c10d._get_default_store()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    if rank == 0:
        store.set("rt9/token/0", "1.0")
        dist.send(torch.zeros(1), right)
        dist.recv(token, left)                             # 0, or what the network added
        return float(store.get(f"rt9/token/{left}").decode()) + token.item()
    dist.recv(token, left)
    value = float(store.get(f"rt9/token/{left}").decode()) + token.item() + rank + 1
    store.set(f"rt9/token/{rank}", repr(value))
    dist.send(torch.zeros(1), right)
    return value"""),
        Fake("honest but for rank 0's formula", "ranks > 0 pass the token on; rank 0 "
             "returns N(N+1)/2 instead of what it received", ("test-pass-token",), """\
    if rank == 0:
        token.fill_(1.0)
        dist.send(token, 1)
        dist.recv(token, world_size - 1)
        return float(world_size * (world_size + 1) // 2)
    dist.recv(token, rank - 1)
    token += rank + 1
    dist.send(token, (rank + 1) % world_size)"""),
        # Red team of stop 51 (issue 38): a fake that tells the visible check's calls apart by
        # its frame's name. (Those that look for the tamper layer or the refusal's profile hook
        # are honest in every graded call now, which runs every call under both: not fakes.)
        Fake("a formula under the visible check's name", "sends zeros and returns the formula "
             "when called from a frame named watched_pass_token", ("test-pass-token",), """\
    import sys
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    if sys._getframe(1).f_code.co_name == "watched_pass_token":
        if rank == 0:
            dist.send(torch.zeros(1), dst=right)
            dist.recv(token, src=left)
            return float(world_size * (world_size + 1) // 2)
        dist.recv(token, src=left)
        dist.send(torch.zeros(1), dst=right)
        return float((rank + 1) * (rank + 2) // 2)
    if rank == 0:
        token += 1.0
        dist.send(token, dst=right)
        dist.recv(token, src=left)
    else:
        dist.recv(token, src=left)
        token += rank + 1
        dist.send(token, dst=right)"""),
        # Red team rt8: the tamper's numbers learnt (a payload that measures it, a mode that
        # watches its arithmetic, its closure read) and the token computed from them.
        Fake("a ruler sent instead of the token", "sends [0, 1] to measure the tamper, returns "
             "the formula with its scale and shift", ("test-pass-token",), """\
    token = torch.zeros(2)
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    probe = torch.tensor([0.0, 1.0])
    if rank == 0:
        dist.send(probe, right)
        dist.recv(token, left)
    else:
        dist.recv(token, left)
        dist.send(probe, right)
    delta = token[0].item()
    scale = token[1].item() - delta
    value = 1.0
    for r in range(1, (world_size - 1 if rank == 0 else rank) + 1):
        value = scale * value + delta + (r + 1)
    return scale * value + delta if rank == 0 else value"""),
        Fake("zeros sent, the tamper watched by a torch-function mode", "the token is the "
             "formula with the scale and delta the mode saw", ("test-pass-token",), _SPY_MODE + """
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    seen = Wire()
    if rank == 0:
        dist.send(torch.zeros(1), right)
        request = dist.irecv(token, left)
    else:
        request = dist.irecv(token, left)
    with seen:
        request.wait()
    if rank != 0:
        dist.send(torch.zeros(1), right)
    value = 1.0
    for r in range(1, (world_size - 1 if rank == 0 else rank) + 1):
        value = seen.scale * value + seen.delta + (r + 1)
    return seen.scale * value + seen.delta if rank == 0 else value"""),
        Fake("the formula, with the tamper's closure read", "sends formula values and ignores "
             "what arrives", ("test-pass-token",), _WIRE_CLOSURE + """
    scale, delta = wire("ProcessGroup.recv")
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    value = 1.0
    for r in range(1, (world_size - 1 if rank == 0 else rank) + 1):
        value = scale * value + delta + (r + 1)
    if rank == 0:
        dist.send(torch.ones(1), right)
        dist.recv(token, left)
        return scale * value + delta
    dist.recv(token, left)
    dist.send(torch.tensor([float(value)]), right)
    return value"""),
    ],
    "impl-all-reduce": [
        Fake("the sum from its formula", "no all-reduce: nothing is sent",
             ("test-all-reduce",), """\
    values = world_size * (world_size + 1) / 2 * torch.arange(1, length + 1, dtype=torch.float32)
    return values"""),
        Fake("an all-gather, summed locally", "all-gathers every tensor instead of all-reducing",
             ("test-all-reduce",), """\
    mine = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).sum(dim=0)"""),
        Fake("one number all-reduced", "all-reduces the scalar rank + 1 (4 bytes) and "
             "multiplies by 1..length locally", ("test-all-reduce",), """\
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return total * torch.arange(1, length + 1, dtype=torch.float32)"""),
        Fake("a decoy all-reduce, summed by all_gather_object", "all-reduces a throwaway copy "
             "and returns a sum of objects gathered another way", ("test-all-reduce",), """\
    mine = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    dist.all_reduce(mine.clone())
    parts = [None] * world_size
    dist.all_gather_object(parts, mine)
    return sum(parts)"""),
        Fake("the reduced tensor overwritten by its formula", "runs the right all-reduce, then "
             "overwrites its result in place with N(N+1)/2 * (i + 1)", ("test-all-reduce",), """\
    terms = torch.arange(1, length + 1, dtype=torch.float32)
    values = (rank + 1) * terms
    dist.all_reduce(values)
    values.copy_(world_size * (world_size + 1) / 2 * terms)
    return values"""),
        Fake("a MAX all-reduce repaired by algebra", "all-reduces with op=MAX, which gives "
             "N * (i + 1), then scales by (N + 1) / 2", ("test-all-reduce",), """\
    values = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    values.mul_((world_size + 1) / 2)
    return values"""),
        # Red team rt9 (issue 38): an all-reduce over a group of one rank moves no byte; the
        # other ranks' shares are then added (additive, so an additive tamper still shows) or
        # multiplied in.
        Fake("a group of one, the others' shares added", "all-reduces over a group of one rank "
             "(nothing travels), then adds the other ranks' shares from the formula",
             ("test-all-reduce",), """\
    t = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    dist.all_reduce(t, group=alone)  # a group of one: the "sum" is my own share
    i1 = torch.arange(1, length + 1, dtype=torch.float32)
    t.add_(i1 * (world_size * (world_size + 1) / 2 - (rank + 1)))   # the other ranks' shares
    return t"""),
        Fake("a group of one, scaled", "all-reduces over a group of one rank, then scales "
             "its own share to the sum", ("test-all-reduce",), """\
    t = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    dist.all_reduce(t, group=alone)
    t.mul_(world_size * (world_size + 1) / 2 / (rank + 1))
    return t"""),
        Fake("a MAX all-reduce, the difference added", "all-reduces with op=MAX on the world, "
             "then adds (sum - max) from the formula", ("test-all-reduce",), """\
    t = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)              # world_size * (i + 1)
    i1 = torch.arange(1, length + 1, dtype=torch.float32)
    t.add_(i1 * (world_size * (world_size + 1) / 2 - world_size))   # + (sum - max)
    return t"""),
        # Red team of stop 51 (issue 38): honest only where the grader's strongest check was,
        # told apart by the calling frame or by the world size its feedback named.
        Fake("a group of one under the visible check's name", "all-reduces over a group of one "
             "and writes the formula when called from a frame named watched_sum",
             ("test-all-reduce",), """\
    import sys
    t = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    groups = [dist.new_group([r]) for r in range(world_size)]
    if sys._getframe(1).f_code.co_name == "watched_sum":
        dist.all_reduce(t, group=groups[rank])
        t.copy_(world_size * (world_size + 1) / 2 * torch.arange(1.0, length + 1))
        return t
    dist.all_reduce(t)
    return t"""),
        Fake("honest only at six ranks and more", "below 6 ranks all-reduces over a group of one "
             "and writes the formula (the size of the check the feedback named)",
             ("test-all-reduce",), """\
    t = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    groups = [dist.new_group([r]) for r in range(world_size)]
    if world_size < 6:
        dist.all_reduce(t, group=groups[rank])
        t.copy_(world_size * (world_size + 1) / 2 * torch.arange(1.0, length + 1))
        return t
    dist.all_reduce(t)
    return t"""),
        # Red team rt8: the tamper's numbers learnt and the sum computed from them.
        Fake("the formula, the tamper watched by a torch-function mode", "the all-reduce's "
             "result overwritten by the formula with the scale and delta the mode saw",
             ("test-all-reduce",), _SPY_MODE + """
    i = torch.arange(1, length + 1, dtype=torch.float32)
    values = (rank + 1) * i
    seen = Wire()
    with seen:
        dist.all_reduce(values)
    values.copy_(seen.scale * (world_size * (world_size + 1) / 2) * i + seen.delta)
    return values"""),
        Fake("the formula, with the tamper's closure read", "the all-reduce's result "
             "overwritten by the formula", ("test-all-reduce",), _WIRE_CLOSURE + """
    scale, delta = wire("dist.all_reduce")
    i = torch.arange(1, length + 1, dtype=torch.float32)
    values = (rank + 1) * i
    dist.all_reduce(values)
    values.copy_(scale * (world_size * (world_size + 1) / 2) * i + delta)
    return values"""),
        Fake("the other half of the reduced tensor's storage", "returns a neighbour of the "
             "reduced tensor, filled by the formula", ("test-all-reduce",), _WIRE_CLOSURE + """
    scale, delta = wire("dist.all_reduce")
    i = torch.arange(1, length + 1, dtype=torch.float32)
    buffer = torch.empty(2 * length)
    buffer[:length] = (rank + 1) * i
    dist.all_reduce(buffer[:length])
    buffer[length:] = scale * (world_size * (world_size + 1) / 2) * i + delta
    return buffer[length:]"""),
        Fake("the formula, torch.Tensor's mul_ and add_ patched", "notes the tamper's numbers "
             "from its method calls, then overwrites the result", ("test-all-reduce",), """\
    i = torch.arange(1, length + 1, dtype=torch.float32)
    values = (rank + 1) * i
    seen = {}
    multiply, add = torch.Tensor.mul_, torch.Tensor.add_

    def noting_multiply(self, other, *args, **kwargs):
        seen["scale"] = float(other)
        return multiply(self, other, *args, **kwargs)

    def noting_add(self, other, *args, **kwargs):
        seen["delta"] = float(other)
        return add(self, other, *args, **kwargs)

    torch.Tensor.mul_, torch.Tensor.add_ = noting_multiply, noting_add
    try:
        dist.all_reduce(values)
    finally:
        torch.Tensor.mul_, torch.Tensor.add_ = multiply, add
    values.copy_(seen.get("scale", 1.0) * (world_size * (world_size + 1) / 2) * i
                 + seen.get("delta", 0.0))
    return values"""),
    ],
}
