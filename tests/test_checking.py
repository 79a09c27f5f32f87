"""minidist.core.checking: what the labs' checks record of a function's torch.distributed calls, and
the library's versions they make unavailable."""

import inspect

import pytest
import torch
import torch.distributed as dist

from minidist.core.checking import (
    LibraryVersionUsed,
    recording,
    tampered_receives,
    unavailable,
)
from minidist.core.launch import run
from minidist.parallel import tensor_parallel


def _reductions_and_all_to_alls(rank, world_size):
    with recording() as calls:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX)
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2), dist.ReduceOp.MIN)
        rows = [1, 2] if rank == 0 else [3, 0]
        received = [1, 3] if rank == 0 else [2, 0]
        dist.all_to_all_single(torch.empty(sum(received), 4), torch.ones(sum(rows), 4),
                               received, rows)
        dist.all_to_all_single(torch.empty(4, 2), input=torch.ones(4, 2))
        dist.all_gather([torch.empty(5), torch.empty(5)], torch.ones(5))
    return [(c.name, c.op, c.sent) for c in calls], calls[-1].shape


def test_recording_names_each_reduction_and_the_bytes_an_all_to_all_sends_to_each_rank():
    (reports, gathered), (other, _) = run(_reductions_and_all_to_alls, 2)
    row = 4 * 4
    assert gathered == (5,)  # all_gather's first tensor: the first of its output list
    assert reports[:-1] == [("all_reduce", "MAX", None), ("all_reduce", "SUM", None),
                          ("all_reduce", "MIN", None), ("all_to_all_single", None, (row, 2 * row)),
                          ("all_to_all_single", None, (16, 16))]
    assert other[3] == ("all_to_all_single", None, (3 * row, 0))


def test_unavailable_refuses_a_class_method_and_puts_it_back():
    apply = vars(tensor_parallel.CopyToParallel).get("apply")
    # A refusal caught inside the block is raised again as the block ends.
    with pytest.raises(LibraryVersionUsed, match="caught the refusal and went on"):
        with unavailable("minidist.parallel.tensor_parallel.CopyToParallel.apply",
                         "minidist.parallel.tensor_parallel.vocab_parallel_cross_entropy"):
            with pytest.raises(LibraryVersionUsed, match="CopyToParallel.apply: write your own"):
                tensor_parallel.CopyToParallel.apply(torch.ones(1), None)
            with pytest.raises(LibraryVersionUsed, match="vocab_parallel_cross_entropy"):
                tensor_parallel.vocab_parallel_cross_entropy(torch.ones(1, 2), torch.zeros(1))
    # apply is inherited from torch.autograd.Function: it is inherited again, and works
    assert vars(tensor_parallel.CopyToParallel).get("apply") is apply
    x = torch.ones(2, requires_grad=True)
    assert torch.equal(tensor_parallel.CopyToParallel.apply(x, None), x)


def test_unavailable_names_a_path_that_does_not_exist():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        with unavailable("minidist.parallel.tensor_parallel.CopyToParallel.nothing"):
            pass


def _every_path_to_a_refused_answer(rank, world_size):
    """Each way a fake might reach the library's or torch's answer, tried inside the block."""
    import functools

    import torch.distributed._functional_collectives as functional
    from torch.distributed.distributed_c10d import all_reduce as c10d_all_reduce

    from minidist.communication import comm
    from minidist.communication.comm import ring_all_reduce as imported_by_name

    alias, partial = comm.ring_all_reduce, functools.partial(comm.ring_all_reduce)
    ring, t, world = comm.ring_of(None, "test"), torch.ones(4), dist.group.WORLD
    paths = {
        "from-import": lambda: imported_by_name(t),
        "alias": lambda: alias(t),
        "functools.partial": lambda: partial(t),
        "private helper": lambda: comm._ring(t, ring, False),
        "distributed_c10d": lambda: c10d_all_reduce(t),
        "process group": lambda: world.allreduce([t]).wait(),
        "functional collective": lambda: functional.all_reduce(t, "sum", world),
        "dispatcher op": lambda: torch.ops._c10d_functional.all_reduce(t, "sum",
                                                                      world.group_name),
        "C function": lambda: torch.chunk(t, 2),
        "C function by another name": lambda: __import__("torch").tensor_split(t, 2),
    }
    refused = {}
    try:
        with unavailable("minidist.communication.comm.*", "torch.distributed.all_reduce",
                         "torch.chunk", "torch.tensor_split", reason="test"):
            for path, call in paths.items():
                try:
                    call()
                    refused[path] = "ran"
                except LibraryVersionUsed as error:
                    refused[path] = "refused" if "write your own" in str(error) else str(error)
        refused["caught refusals"] = "not raised again"
    except LibraryVersionUsed as error:  # the refusals caught above, raised again at the end
        refused["caught refusals"] = "refused" if "went on" in str(error) else str(error)
    # Everything is back: each path runs again.
    for path in ("from-import", "distributed_c10d", "process group", "C function"):
        paths[path]()
    imported_by_name(t)
    return refused


def test_unavailable_refuses_every_path_to_the_answer_by_identity():
    """A name bound by `from ... import`, an alias, a partial, a private helper of the module,
    distributed_c10d's function, the process group's method, the functional collectives and
    the dispatcher's op all meet the refusal; afterwards all work again."""
    for refused in run(_every_path_to_a_refused_answer, 2):
        ran = [path for path, outcome in refused.items() if outcome != "refused"]
        assert not ran, f"reached the refused answer through {ran}: {refused}"


def _copies_backends_and_tampering(rank, world_size):
    """A copy of the library loaded again from its file, torch's backend below the process
    group, and a received message tampered with."""
    import importlib.util
    import sys

    from minidist.communication import comm

    found = {}
    spec = importlib.util.spec_from_file_location("comm_copy", comm.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules["comm_copy"] = copy
    spec.loader.exec_module(copy)
    source = {}
    exec(compile(inspect.getsource(comm.chunk_bounds), "<copy>", "exec"), source)
    t = torch.arange(8.0) * (rank + 1)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    tries = {"module loaded again": lambda: copy.ring_all_reduce(t.clone()),
             "source exec'd": lambda: source["chunk_bounds"](8, 2),
             "backend below the process group": lambda: backend.allreduce([t.clone()]).wait()}
    for path, call in tries.items():  # one block each: a refusal ends its block too
        try:
            with unavailable("minidist.communication.comm.*", "torch.distributed.all_reduce"):
                call()
            found[path] = "ran"
        except LibraryVersionUsed:
            found[path] = "refused"
    reference = t.clone()
    comm.ring_all_reduce(reference)
    with tampered_receives(delta=1.0, nth=0) as sources:
        tampered = t.clone()
        comm.ring_all_reduce(tampered)
    found["tampering changed the result"] = not torch.equal(tampered, reference)
    found["left neighbour first"] = sources[0] == (rank - 1) % world_size
    with recording() as calls:
        mine = torch.full((3,), float(rank))
        dist.all_reduce(mine)
    found["recorded the tensor and what it held"] = (
        calls[0].tensor is mine and calls[0].before.tolist() == [float(rank)] * 3)
    return found


def test_copies_of_the_library_and_the_backend_are_refused_and_receives_can_be_tampered():
    """Refusal by code identity catches a module loaded again and exec'd source; torch's
    backend under the process group is refused with dist.all_reduce; tampered_receives
    changes what a ring receives, so its result changes; recording keeps the tensor and what
    it held."""
    for found in run(_copies_backends_and_tampering, 3):
        wrong = {what: outcome for what, outcome in found.items()
                 if outcome not in ("refused", True)}
        assert not wrong, f"expected each refused or true: {found}"



def test_unavailable_module_star_leaves_the_allowed_functions_callable():
    """"module.*" with `allow`: the scaffolding an exercise is given still runs, and so does a
    copy of it (its code is not fingerprinted); every other function of the module refuses."""
    from minidist.communication import comm

    source = {}
    exec(compile(inspect.getsource(comm.chunk_bounds), "<copy>", "exec"), source)
    expected = comm.chunk_bounds(8, 2)
    with unavailable("minidist.communication.comm.*",
                     allow=("minidist.communication.comm.chunk_bounds",)):
        assert comm.chunk_bounds(8, 2) == expected
        assert source["chunk_bounds"](8, 2) == expected
    with pytest.raises(LibraryVersionUsed, match="comm.ring_of: write your own"):
        with unavailable("minidist.communication.comm.*",
                         allow=("minidist.communication.comm.chunk_bounds",)):
            comm.ring_of(None, "test")
    assert comm.chunk_bounds(8, 2) == expected  # and everything is back
