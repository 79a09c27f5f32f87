"""Fakes of Lab 00's exercises: the right values without the communication they teach."""

from fakes import Fake

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
    ],
}
