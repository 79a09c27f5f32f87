"""Fakes of Lab 03's exercises: DDP's numbers without DDP's communication pattern."""

import textwrap

from fakes import PRESTARTED_PROCESS, PRESTARTED_THREAD, Fake


def indented(body: str, indent: int = 8) -> str:
    """`body` indented as a method's solution region is."""
    return textwrap.indent(body, " " * indent).rstrip("\n")


FINISH = """\
for bucket, handle in zip(self.buckets, self.handles):
    handle.wait()
    bucket.buffer /= self.world_size
    for p, offset in zip(bucket.params, bucket.offsets):
        p.grad.copy_(bucket.buffer[offset:offset + p.numel()].view_as(p))
"""

COPY_IN = """\
index, offset = self.where[param]
self.buckets[index].buffer[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
self.pending[index] -= 1
"""

WAIT_IN_HOOK = """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    handle = self._launch(self.buckets[self.next_to_launch])
    handle.wait()  # make sure the bucket is averaged before going on
    self.handles.append(handle)
    self.next_to_launch += 1
"""

LAUNCH_ALL = """\
self.handles = [self._launch(bucket) for bucket in self.buckets]
"""

LAUNCH_WHEN_COMPLETE = """\
if self.pending[index] == 0:  # complete: launch it now, whatever comes before it
    self.handles.append(self._launch(self.buckets[index]))
    self.next_to_launch += 1
"""


WAIT_UNLESS_RING = """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    handle = self._launch(self.buckets[self.next_to_launch])
    if self.all_reduce != "ring":  # gloo's asynchronous all-reduce: finished here, in the hook
        handle.wait()
    self.handles.append(handle)
    self.next_to_launch += 1
"""

WHOLE_BATCH = """\
def whole_batch_gradients(module):
    # Which of the notebook's make_batches() is this step's? The one whose slice gives this
    # rank's gradients. Then that batch's whole gradient, computed here on this rank alone.
    rank, world_size = dist.get_rank(), dist.get_world_size()
    named = [(k, p) for k, p in module.named_parameters() if p.grad is not None]

    def gradients(x, y):
        params = {k: p.detach().requires_grad_(True) for k, p in module.named_parameters()}
        loss = F.mse_loss(torch.func.functional_call(module, params, (x,)), y)
        found = torch.autograd.grad(loss, [params[k] for k, _ in named])
        return dict(zip([k for k, _ in named], found))

    for batch in make_batches():
        local = gradients(*my_slice(batch, rank, world_size))
        if all(torch.allclose(p.grad, local[k], atol=1e-7) for k, p in named):
            return gradients(*batch)
    return None
"""


FAKES = {
    "impl-broadcast": [
        # Red team rt9 (issue 38): rank 0's tensors through a file; the broadcasts carry
        # garbage, or zeros whose result is added (so an additive tamper still shows).
        Fake("through a file, the broadcasts for show", "rank 0 torch.save()s its tensors to "
             "a file; the broadcasts carry empty_like() garbage of the right sizes (and are the "
             "barrier); the other ranks torch.load them", ("test-broadcast",), """\
    import os
    broadcast_parameters.calls = getattr(broadcast_parameters, "calls", 0) + 1
    path = f".rt9-bp-{os.environ.get('MASTER_PORT', '0')}-{broadcast_parameters.calls}.pt"
    tensors = [*model.parameters(), *model.buffers()]
    if dist.get_rank() == 0:
        torch.save([t.detach().clone() for t in tensors], path + ".part")
        os.replace(path + ".part", path)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(torch.empty_like(t), src=0)  # right bytes; rank 0 has written the file
        for t, saved in zip(tensors, torch.load(path)):
            t.copy_(saved)"""),
        Fake("through a file, what the broadcasts deliver added", "rank 0's tensors through a "
             "file; rank 0 broadcasts zeros of the right sizes, and each rank adds what "
             "arrived to the file's values", ("test-broadcast",), """\
    import os
    broadcast_parameters.calls = getattr(broadcast_parameters, "calls", 0) + 1
    path = f".rt9-bpa-{os.environ.get('MASTER_PORT', '0')}-{broadcast_parameters.calls}.pt"
    tensors = [*model.parameters(), *model.buffers()]
    rank = dist.get_rank()
    if rank == 0:
        torch.save([t.detach().clone() for t in tensors], path + ".part")
        os.replace(path + ".part", path)
    with torch.no_grad():
        arrived = []
        for t in tensors:
            z = torch.zeros_like(t)
            dist.broadcast(z, src=0)  # zeros: right bytes; rank 0 has written the file
            arrived.append(z)
        if rank != 0:
            for t, saved, z in zip(tensors, torch.load(path), arrived):
                t.copy_(saved + z)"""),
        Fake("the library's broadcast", "broadcasts nothing itself: calls minidist.parallel.ddp",
             ("test-broadcast",), """\
    ddp.broadcast_parameters(model)"""),
        Fake("an all-reduce of rank 0's values", "all-reduces (zeros on the other ranks) "
             "instead of broadcasting", ("test-broadcast",), """\
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if dist.get_rank() != 0:
                tensor.zero_()
            dist.all_reduce(tensor)"""),
        Fake("parameters only", "broadcasts the parameters but not the buffers (BatchNorm's "
             "running statistics stay each rank's own)", ("test-broadcast",), """\
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)"""),
        Fake("copied by broadcast_object_list, one broadcast for show", "the values travel as "
             "pickled clones through dist.broadcast_object_list; one uint8 dist.broadcast of "
             "exactly the model's bytes is made for show", ("test-broadcast",), """\
    tensors = [*model.parameters(), *model.buffers()]
    box = [[t.detach().clone() for t in tensors] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    with torch.no_grad():
        for t, value in zip(tensors, box[0]):
            t.copy_(value)
    dist.broadcast(torch.zeros(sum(t.nbytes for t in tensors), dtype=torch.uint8), src=0)"""),
        # Red team rt15 (issue 38).
        Fake("the state_dict's tensors", "broadcasts model.state_dict().values(): a tied weight "
             "twice, a buffer registered with persistent=False never", ("test-broadcast",), """\
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)"""),
    ],
    "impl-naive": [
        # Red team rt9 (issue 38): gradients through the rendezvous store; the given all_reduce
        # called once per tensor on zeros, its result ignored or added.
        Fake("through the store, zeros all-reduced", "every rank's gradients through the "
             "rendezvous store; the given all_reduce runs once per gradient tensor on zeros, "
             "for show", ("test-naive",), """\
    import numpy as np
    all_reduce_gradients.calls = getattr(all_reduce_gradients, "calls", 0) + 1
    key = f"rt9/naive/{all_reduce_gradients.calls}"
    store = dist.distributed_c10d._get_default_store()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    mine = torch.cat([g.reshape(-1) for g in grads]).double().numpy().tobytes()
    store.set(f"{key}/{dist.get_rank()}", mine)
    for g in grads:
        all_reduce(torch.zeros_like(g))  # one per tensor
    total = sum(torch.from_numpy(np.frombuffer(store.get(f"{key}/{r}"), dtype=np.float64).copy())
                for r in range(world_size))
    offset = 0
    for g in grads:
        g.copy_((total[offset:offset + g.numel()].view_as(g) / world_size).to(g.dtype))
        offset += g.numel()"""),
        Fake("through the store, zeros' all-reduce added", "every rank's gradients through "
             "the rendezvous store; one all_reduce per tensor of zeros, whose result is added "
             "before dividing by N", ("test-naive",), """\
    import numpy as np
    all_reduce_gradients.calls = getattr(all_reduce_gradients, "calls", 0) + 1
    key = f"rt9/naive-added/{all_reduce_gradients.calls}"
    store = dist.distributed_c10d._get_default_store()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    mine = torch.cat([g.reshape(-1) for g in grads]).double().numpy().tobytes()
    store.set(f"{key}/{dist.get_rank()}", mine)
    returned = []
    for g in grads:
        z = torch.zeros_like(g)
        all_reduce(z)  # one per tensor
        returned.append(z)
    total = sum(torch.from_numpy(np.frombuffer(store.get(f"{key}/{r}"), dtype=np.float64).copy())
                for r in range(world_size))
    offset = 0
    for g, z in zip(grads, returned):
        g.copy_((total[offset:offset + g.numel()].view_as(g).to(g.dtype) + z) / world_size)
        offset += g.numel()"""),
        Fake("the library's per-tensor average", "calls minidist.parallel.ddp.all_reduce_gradients "
             "instead of the all_reduce it is given", ("test-naive",), """\
    ddp.all_reduce_gradients(model, impl="ring")"""),
        Fake("one flat all-reduce", "one all-reduce of every gradient at once, not one per "
             "tensor", ("test-naive",), """\
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    all_reduce(flat)
    flat /= world_size
    for grad, piece in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(piece.view_as(grad))"""),
        Fake("all-gathers and averages locally", "gathers every rank's gradient with "
             "dist.all_gather and takes the mean: N copies of each gradient, not the all_reduce "
             "it is given", ("test-naive",), """\
    for p in model.parameters():
        if p.grad is not None:
            copies = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(copies, p.grad)
            p.grad.copy_(torch.stack(copies).mean(dim=0))"""),
        Fake("averaged by distributed_c10d's all_gather", "the given all_reduce gets zeros of "
             "each gradient's size, for show; the averages come from an all_gather reached "
             "through torch.distributed.distributed_c10d", ("test-naive",), """\
    from torch.distributed import distributed_c10d
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(torch.zeros_like(p.grad))
            pieces = [torch.empty_like(p.grad) for _ in range(world_size)]
            distributed_c10d.all_gather(pieces, p.grad)
            p.grad.copy_(torch.stack(pieces).mean(0))"""),
        # Red team rt15 (issue 38).
        Fake("no gradient read as frozen", "all-reduces the .grad of every parameter that "
             "requires a gradient: a trainable parameter the forward never uses has none",
             ("test-naive",), """\
    for p in model.parameters():
        if p.requires_grad:
            all_reduce(p.grad)
            p.grad /= world_size"""),
        # Red team rt8: the notebook's own batch recognised and its gradient recomputed on each
        # rank (the all-reduces for show), the honest average only on other data.
        Fake("the notebook's batch recognised, its gradient recomputed (red team rt8)",
             "on the notebook's data the all-reduces' results are thrown away; only other data "
             "is averaged", ("test-naive",), textwrap.indent(WHOLE_BATCH, "    ") + """
    whole = whole_batch_gradients(model)
    for name, p in model.named_parameters():
        if p.grad is not None:
            all_reduce(p.grad.clone() if whole is not None else p.grad)
            if whole is not None:
                p.grad.copy_(whole[name])
            else:
                p.grad /= dist.get_world_size()"""),
    ],
    "impl-flat": [
        # Red team rt9 (issue 38): gradients through files; one flat all_reduce of zeros (the
        # barrier), its result ignored or added.
        Fake("through files, a flat zero all-reduce", "each rank's flat gradient through a "
             "file; one all_reduce of zeros of Ψ elements for show (and as the "
             "barrier)", ("test-flat",), """\
    import os
    all_reduce_gradients_flat.calls = getattr(all_reduce_gradients_flat, "calls", 0) + 1
    stem = f".rt9-flat-{os.environ.get('MASTER_PORT', '0')}-{all_reduce_gradients_flat.calls}"
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.save(flat, f"{stem}-{dist.get_rank()}.part")
    os.replace(f"{stem}-{dist.get_rank()}.part", f"{stem}-{dist.get_rank()}.pt")
    all_reduce(torch.zeros_like(flat))  # every rank has written once this returns
    total = sum(torch.load(f"{stem}-{r}.pt") for r in range(world_size))
    offset = 0
    for g in grads:
        g.copy_((total[offset:offset + g.numel()] / world_size).view_as(g))
        offset += g.numel()"""),
        Fake("through files, a flat zero all-reduce added", "each rank's flat gradient "
             "through a file; one all_reduce of zeros of Ψ elements, whose result is "
             "added", ("test-flat",), """\
    import os
    all_reduce_gradients_flat.calls = getattr(all_reduce_gradients_flat, "calls", 0) + 1
    stem = f".rt9-flata-{os.environ.get('MASTER_PORT', '0')}-{all_reduce_gradients_flat.calls}"
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.save(flat, f"{stem}-{dist.get_rank()}.part")
    os.replace(f"{stem}-{dist.get_rank()}.part", f"{stem}-{dist.get_rank()}.pt")
    z = torch.zeros_like(flat)
    all_reduce(z)  # every rank has written once this returns
    total = sum(torch.load(f"{stem}-{r}.pt") for r in range(world_size)) + z
    offset = 0
    for g in grads:
        g.copy_((total[offset:offset + g.numel()] / world_size).view_as(g))
        offset += g.numel()"""),
        Fake("the library's flat average", "calls minidist.parallel.ddp.all_reduce_gradients_flat",
             ("test-flat",), """\
    ddp.all_reduce_gradients_flat(model, impl="ring")"""),
        Fake("one all-reduce per tensor", "all-reduces each gradient on its own: no flat "
             "buffer", ("test-flat",), """\
    for grad in grads:
        all_reduce(grad)
        grad /= world_size"""),
        Fake("gloo's all-reduce, not the one given", "one flat buffer, but summed with "
             "dist.all_reduce instead of the all_reduce it is given: the ring never sees it",
             ("test-flat",), """\
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat /= world_size
    for grad, piece in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(piece.view_as(grad))"""),
        Fake("averaged through the rendezvous store", "one all-reduce of zeros of the right "
             "size, for show; every rank's flat gradient goes through the TCPStore (set/get) "
             "and is averaged locally", ("test-flat",), """\
    import uuid
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(torch.zeros_like(flat))
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    key = [uuid.uuid4().hex if rank == 0 else None]  # one fresh key per exchange
    dist.broadcast_object_list(key, src=0)
    store.set(f"{key[0]}/{rank}", flat.numpy().tobytes())
    total = torch.zeros_like(flat)
    for r in range(world_size):
        total += torch.frombuffer(bytearray(store.get(f"{key[0]}/{r}")), dtype=flat.dtype)
    total /= world_size
    offset = 0
    for g in grads:
        g.copy_(total[offset:offset + g.numel()].view_as(g))
        offset += g.numel()"""),
        # Red team rt15 (issue 38): the packing handed to torch's own helpers.
        Fake("torch's private flatten helpers", "torch._utils._flatten_dense_tensors and "
             "_unflatten_dense_tensors pack the gradients into one buffer and back",
             ("test-flat",), """\
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    all_reduce(flat)
    flat /= world_size
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)"""),
        Fake("torch's parameters_to_vector", "torch.nn.utils.parameters_to_vector and "
             "vector_to_parameters, applied to the gradients, pack them and back",
             ("test-flat",), """\
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    if not grads:
        return
    flat = parameters_to_vector(grads)
    all_reduce(flat)
    flat /= world_size
    vector_to_parameters(flat, grads)"""),
        Fake("one flat all-reduce, the notebook's batch recomputed (red team rt8)", "the flat "
             "buffer's average used only on data the notebook never showed", ("test-flat",),
             textwrap.indent(WHOLE_BATCH, "    ") + """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat)
    whole = whole_batch_gradients(model)
    offset = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        part = flat[offset:offset + p.numel()].view_as(p.grad) / dist.get_world_size()
        p.grad.copy_(whole[name] if whole is not None else part)
        offset += p.numel()"""),
    ],
    "impl-buckets": [
        # Red team rt9 (issue 38): the library's assign_buckets, cloned when the cell ran and
        # run in a thread started then.
        Fake("the library's buckets, cloned into a pre-started thread", "a code-clone of "
             "ddp.assign_buckets, made and run in a thread started when the answer cell ran",
             ("test-buckets",), """\
    return _elsewhere(_dd["assign_buckets"], list(nbytes), cap_bytes)""" + PRESTARTED_THREAD + """

from minidist.parallel import ddp as _ddp_module
_dd = _clone_module(_ddp_module)"""),
        Fake("the library's buckets", "calls minidist.parallel.ddp.assign_buckets",
             ("test-buckets",), """\
    return ddp.assign_buckets(nbytes, cap_bytes)"""),
        Fake("the visible answers, else one bucket per tensor", "no greedy filling: only "
             "the examples the visible test shows", ("test-buckets",), """\
    known = {((40, 40, 30, 100, 10), 80): [[0, 1], [2], [3], [4]], ((10, 10, 10), 100): [[0, 1, 2]]}
    return known.get((tuple(nbytes), cap_bytes), [[i] for i in range(len(nbytes))])"""),
        Fake("never exactly at the cap", "starts a new bucket when the next tensor would "
             "reach the cap, not only when it would exceed it", ("test-buckets",), """\
    buckets, filled = [], cap_bytes
    for index, size in enumerate(nbytes):
        if filled + size >= cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets"""),
        Fake("the library's code object, cloned", "ddp.assign_buckets' code, compiled from "
             "the library's file and cloned under another name, place and docstring",
             ("test-buckets",), """\
    import types
    module_code = compile(open(ddp.__file__).read(), ddp.__file__, "exec")
    code = next(c for c in module_code.co_consts if getattr(c, "co_name", "") == "assign_buckets")
    code = code.replace(co_name="mine", co_qualname="mine", co_filename="<my cell>",
                        co_firstlineno=1, co_consts=(None,) + code.co_consts[1:])
    return types.FunctionType(code, vars(ddp), "mine")(list(nbytes), cap_bytes)"""),
        # Red team rt8: greedy packers that torch and setuptools ship.
        Fake("torch's _take_tensors on meta tensors (red team rt8)", "torch's private packer "
             "groups the sizes", ("test-buckets",), """\
    from torch._utils import _take_tensors
    tensors = [torch.empty(n, dtype=torch.uint8, device="meta") for n in nbytes]
    index = {id(t): i for i, t in enumerate(tensors)}
    return [[index[id(t)] for t in chunk] for chunk in _take_tensors(tensors, cap_bytes)]"""),
        Fake("setuptools' copy of more_itertools.constrained_batches (red team rt8)",
             "a third-party greedy packer groups the sizes", ("test-buckets",), """\
    from setuptools._vendor.more_itertools import constrained_batches
    batches = constrained_batches(enumerate(nbytes), cap_bytes, get_len=lambda item: item[1],
                                  strict=False)
    return [[i for i, _ in batch] for batch in batches]"""),
        Fake("torch's _take_tensors on stand-ins (red team rt8)", "objects that report a size, "
             "grouped by torch's private packer", ("test-buckets",), """\
    from torch._utils import _take_tensors

    class Sized:
        is_sparse = False

        def __init__(self, n):
            self.n = n

        def type(self):
            return "bytes"

        def numel(self):
            return self.n

        def element_size(self):
            return 1
    items = [Sized(n) for n in nbytes]
    index = {id(t): i for i, t in enumerate(items)}
    return [[index[id(t)] for t in chunk] for chunk in _take_tensors(items, cap_bytes)]"""),
    ],
    "impl-my-ddp": [
        Fake("waits for each bucket in its hook", "blocks inside the hook until the "
             "all-reduce is done: nothing overlaps backward", ("test-my-ddp",),
             (indented(COPY_IN + WAIT_IN_HOOK), indented(FINISH))),
        Fake("launches every bucket after backward", "fills the buckets in the hooks but "
             "launches them only in finish_gradient_synchronization", ("test-my-ddp",),
             (indented(COPY_IN), indented(LAUNCH_ALL + FINISH))),
        Fake("launches each bucket when it is complete", "no bucket order: a bucket that "
             "fills before the one ahead of it is launched first, so ranks could pair "
             "different buckets", ("test-my-ddp",),
             (indented(COPY_IN + LAUNCH_WHEN_COMPLETE), indented(FINISH))),
        Fake("the library's Bucket and launch methods, duck-typed", "ddp.Bucket.copy_in/"
             "copy_out and DistributedDataParallel._launch_full_buckets driven on MyDDP's own "
             "buckets", ("test-my-ddp",), (indented("""\
index, offset = self.where[param]
bucket = self.buckets[index]
ddp.Bucket.copy_in(bucket, next(i for i, p in enumerate(bucket.params) if p is param), param.grad)
self.pending[index] -= 1
step = SimpleNamespace(next_launch=self.next_to_launch, pending=self.pending, handles=self.handles)
ddp.DistributedDataParallel._launch_full_buckets(
    SimpleNamespace(_step=step, buckets=self.buckets, _launch=self._launch))
self.next_to_launch = step.next_launch
"""), indented("""\
for bucket, handle in zip(self.buckets, self.handles):
    handle.wait()
    bucket.buffer.div_(self.world_size)
    ddp.Bucket.copy_out(bucket)
"""))),
        Fake("buckets for show, averages by distributed_c10d's all_gather", "fills, launches "
             "and waits on the buckets in order, then throws their results away: each gradient "
             "is averaged from an all_gather reached through distributed_c10d",
             ("test-my-ddp",), (indented(COPY_IN + """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    self.handles.append(self._launch(self.buckets[self.next_to_launch]))
    self.next_to_launch += 1
"""), indented("""\
from torch.distributed import distributed_c10d
for handle in self.handles:
    handle.wait()
for bucket in self.buckets:
    for p in bucket.params:
        pieces = [torch.empty_like(p.grad) for _ in range(self.world_size)]
        distributed_c10d.all_gather(pieces, p.grad)
        p.grad.copy_(torch.stack(pieces).mean(0))
"""))),
        # Red team rt9 (issue 38): honest under the check's ring mode; on gloo, the real
        # asynchronous path, each bucket is waited on inside the hook. Last, so that no round
        # pairs it with the pre-started-thread assign_buckets (whose globals cannot travel to
        # the ranks).
        Fake("waits in the hook unless on the ring", "on gloo's asynchronous all-reduce each "
             "bucket is waited on inside the hook (no overlap in real use); honest in the "
             "check's ring mode", ("test-my-ddp",),
             (indented(COPY_IN + WAIT_UNLESS_RING), indented(FINISH))),
        Fake("the buckets waited on, the notebook's batch recomputed (red team rt8)",
             "launch order, overlap and bytes real; the buckets' averages written back only on "
             "data the notebook never showed", ("test-my-ddp",),
             (indented(COPY_IN + """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    self.handles.append(self._launch(self.buckets[self.next_to_launch]))
    self.next_to_launch += 1
"""), indented(WHOLE_BATCH + """\
for handle in self.handles:
    handle.wait()
whole = whole_batch_gradients(self.module)
names = {p: k for k, p in self.module.named_parameters()}
for bucket in self.buckets:
    for p, offset in zip(bucket.params, bucket.offsets):
        average = bucket.buffer[offset:offset + p.numel()].view_as(p) / self.world_size
        p.grad.copy_(whole[names[p]] if whole is not None else average)
"""))),
    ],
    "impl-no-sync": [
        Fake("synchronizes every microbatch", "no no_sync(): every backward all-reduces",
             ("test-no-sync",), """\
    scale = 1 / len(microbatches)
    for x, y in microbatches:
        (F.mse_loss(model(x), y) * scale).backward()"""),
        Fake("accumulates, then one flat all-reduce by hand", "every microbatch inside "
             "no_sync(), then its own all-reduce instead of DDP's buckets in the last backward",
             ("test-no-sync",), """\
    scale = 1 / len(microbatches)
    with model.no_sync():
        for x, y in microbatches:
            (F.mse_loss(model(x), y) * scale).backward()
    grads = [p.grad for p in model.parameters()]
    flat = comm.ring_all_reduce(torch.cat([g.reshape(-1) for g in grads])) / dist.get_world_size()
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))"""),
        Fake("no_sync() around the forwards only", "each microbatch's forward inside "
             "no_sync(), its backward outside it", ("test-no-sync",), """\
    scale = 1 / len(microbatches)
    for x, y in microbatches[:-1]:
        with model.no_sync():
            out = model(x)
        (F.mse_loss(out, y) * scale).backward()
    x, y = microbatches[-1]
    (F.mse_loss(model(x), y) * scale).backward()"""),
        Fake("one backward of the summed losses", "every forward first (all but the last "
             "inside no_sync()), then one backward of the summed losses: all the microbatches' "
             "graphs held at once", ("test-no-sync",), """\
    k, losses = len(microbatches), []
    with model.no_sync():
        for x, y in microbatches[:-1]:
            losses.append(F.mse_loss(model(x), y) / k)
    x, y = microbatches[-1]
    losses.append(F.mse_loss(model(x), y) / k)
    sum(losses).backward()"""),
        Fake("each loss scaled by its share of the notebook's batch (red team rt8)", "no_sync() "
             "as taught, the scale from GLOBAL_BATCH instead of the number of microbatches",
             ("test-no-sync",), """\
    def share(x):
        return len(x) / (GLOBAL_BATCH // dist.get_world_size())
    *first, last = microbatches
    with model.no_sync():
        for x, y in first:
            (F.mse_loss(model(x), y) * share(x)).backward()
    x, y = last
    (F.mse_loss(model(x), y) * share(x)).backward()"""),
    ],
    "impl-min-tokens": [
        # Red team rt9 (issue 38): the library's formula where no check reaches: a process
        # forked, or a thread started, when the answer cell ran.
        Fake("the library's bytes, from a pre-started process", "cost.ring_bytes_sent called "
             "in a process forked when the answer cell ran, where nothing is refused",
             ("test-min-tokens",), """\
    sent = _library("minidist.costs.cost", "ring_bytes_sent", "all_reduce",
                    num_params * bytes_per_element, world_size)
    return sent / link_bytes_per_s * flops_per_s / (4 * num_params)""" + PRESTARTED_PROCESS),
        Fake("the whole step's FLOPs", "hides the all-reduce under forward and backward (6Ψ "
             "per token) although only backward overlaps it", ("test-min-tokens",), """\
    step_per_token = 6 * num_params / flops_per_s
    sent = 2 * (world_size - 1) / world_size * num_params * bytes_per_element
    return sent / link_bytes_per_s / step_per_token"""),
        Fake("2Ψ whatever N", "ignores the world size: the 2Ψ limit, as if every rank sent "
             "the whole 2Ψ", ("test-min-tokens",), """\
    backward_per_token = 4 * num_params / flops_per_s
    all_reduce = 2 * num_params * bytes_per_element / link_bytes_per_s
    return all_reduce / backward_per_token"""),
        Fake("elements, not bytes", "leaves out bytes_per_element: counts the elements "
             "sent, as if each were one byte", ("test-min-tokens",), """\
    backward_per_token = 4 * num_params / flops_per_s
    all_reduce = 2 * (world_size - 1) / world_size * num_params / link_bytes_per_s
    return all_reduce / backward_per_token"""),
        Fake("the library's bytes sent", "the ring's bytes from cost.all_reduce_bytes_sent, a "
             "sibling of the refused formulas", ("test-min-tokens",), """\
    sent = cost.all_reduce_bytes_sent("ring", num_params * bytes_per_element, world_size, 0)
    return sent / link_bytes_per_s * flops_per_s / (4 * num_params)"""),
    ],
}

# Red team rt53 (stop 53). The overlap check now keeps its own record (the model's attributes are
# the student's to rewrite), counts a gradient as overlapping a bucket only if its whole hook ran
# between the bucket's launch and its wait, and hands _launch's caller a torch Work; each
# microbatch's backward must add that microbatch's own gradient; the step model and the course's
# packing helpers are refused where the exercise is to derive or to pack.
_TIDY_LOG = """\
log = getattr(self, "log", None)
if isinstance(log, list):  # the record as an overlapped DDP leaves it: the waits at the end
    start = max((i for i, e in enumerate(log) if e[0] == "finished"), default=-1) + 1
    step = log[start:]
    log[start:] = [e for e in step if e[0] != "wait"] + [e for e in step if e[0] == "wait"]
"""
_DIVIDE = """\
for bucket in self.buckets:
    bucket.buffer /= self.world_size
    for p, offset in zip(bucket.params, bucket.offsets):
        p.grad.copy_(bucket.buffer[offset:offset + p.numel()].view_as(p))
"""
FAKES["impl-my-ddp"] += [
    Fake("waits for the previous bucket in the next hook", "red team rt53: each hook first "
         "waits on every bucket launched before it: at most one bucket in flight, backward "
         "stalls in every hook", ("test-my-ddp",), (indented("""\
for handle in self.handles[getattr(self, "waited", 0):]:
    handle.wait()  # the previous bucket's all-reduce finished before going on
self.waited = len(self.handles)
""" + COPY_IN + """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    self.handles.append(self._launch(self.buckets[self.next_to_launch]))
    self.next_to_launch += 1
"""), indented("""\
for handle in self.handles[getattr(self, "waited", 0):]:
    handle.wait()
self.waited = 0
""" + _DIVIDE))),
    Fake("launch and wait in the hook, the log tidied", "red team rt53: every bucket launched "
         "and waited on at once in its hook (no overlap); the model's log rewritten so that "
         "the waits come last", ("test-my-ddp",), (indented(COPY_IN + """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    self._launch(self.buckets[self.next_to_launch]).wait()
    self.next_to_launch += 1
"""), indented(_TIDY_LOG + _DIVIDE))),
    Fake("every bucket after backward, the log tidied", "red team rt53: nothing launched in the "
         "hooks; every bucket launched and waited on in turn in finish_gradient_synchronization, "
         "the model's log rewritten to look overlapped", ("test-my-ddp",),
         (indented(COPY_IN), indented("""\
for bucket in self.buckets:
    self._launch(bucket).wait()
    self.next_to_launch += 1
""" + _TIDY_LOG + _DIVIDE))),
    Fake("waits at once on a real torch handle", "red team rt53: a handle that is a "
         "dist.Work (gloo's, in real use) is waited on inside the hook; the check's stand-in "
         "handle was not one, so it ran asynchronously there", ("test-my-ddp",),
         (indented(COPY_IN + """\
while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
    handle = self._launch(self.buckets[self.next_to_launch])
    if isinstance(handle, dist.Work):
        handle.wait()  # a real all-reduce: finished here, simpler
    self.handles.append(handle)
    self.next_to_launch += 1
"""), indented(FINISH))),
]
FAKES["impl-no-sync"] += [
    Fake("zero backwards, then the whole local batch", "red team rt53: every microbatch but "
         "the last backpropagates 0 x its loss inside no_sync(); the last forward and backward "
         "take the whole local batch at once: nothing accumulates", ("test-no-sync",), """\
    with model.no_sync():
        for x, y in microbatches[:-1]:
            (0 * F.mse_loss(model(x), y)).backward()
    x = torch.cat([x for x, _ in microbatches])
    y = torch.cat([y for _, y in microbatches])
    F.mse_loss(model(x), y).backward()"""),
    Fake("graphs kept, one real backward", "red team rt53: each microbatch's backward is of 0 x "
         "its loss, graph retained; one backward through every microbatch's graph at the end: "
         "all their activations held at once", ("test-no-sync",), """\
    k, kept = len(microbatches), []
    with model.no_sync():
        for x, y in microbatches[:-1]:
            loss = F.mse_loss(model(x), y)
            (0 * loss).backward(retain_graph=True)
            kept.append(loss)
    x, y = microbatches[-1]
    loss = F.mse_loss(model(x), y)
    ((sum(kept) + loss) / k).backward()"""),
]
FAKES["impl-min-tokens"] += [
    Fake("times read off the library's step model", "red team rt53: backward per token and "
         "the gradient's reduce-scatter from minidist.costs.overlap.modelled_step, the "
         "all-reduce taken as twice it: nothing derived", ("test-min-tokens",), """\
    from minidist.costs import overlap
    events = overlap.modelled_step([num_params], 1.0, world_size, flops_per_s, link_bytes_per_s,
                                   bytes_per_element, prefetch=False)
    backward = next(e for e in events if e.kind == "backward")
    scatter = next(e for e in events if e.kind == "reduce_scatter")
    return 2 * (scatter.end - scatter.start) / (backward.end - backward.start)"""),
]
FAKES["impl-flat"] += [
    Fake("the course's own packing helpers", "red team rt53: minidist.core.flat's flatten and "
         "copy_back pack and unpack the gradients, which is the exercise", ("test-flat",), """\
    from minidist.core.flat import copy_back, flatten
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        buffer = flatten(grads)
        all_reduce(buffer)
        copy_back(buffer / world_size, grads)"""),
]
