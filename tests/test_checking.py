"""minidist.core.checking and .refusal: what the labs' checks record of a function's
torch.distributed calls, and the library's versions they make unavailable."""

import inspect
import io
import os
import re
import signal
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.core.checking import recording, tampered_receives
from minidist.core.launch import run
from minidist.core.refusal import (
    TORCH_COLLECTIVES,
    LibraryVersionUsed,
    _may_descend,
    _strangers,
    unavailable,
)
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
        "private helper": lambda: comm._fold_in(t, ring, comm.WHOLE),
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
    # Pasted under another name, its locals renamed (code written anew alike is in
    # test_a_copy_is_refused_however_it_was_renamed_unless_it_is_short_and_written_anew).
    pasted = re.sub(r"\bbounds\b", "mine", inspect.getsource(comm.chunk_bounds).replace(
        "def chunk_bounds", "def my_bounds"))
    exec(compile(pasted, "<pasted>", "exec"), source)
    renamed_code = types.FunctionType(comm.chunk_bounds.__code__.replace(co_name="mine"), {})
    t = torch.arange(8.0) * (rank + 1)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    tries = {"module loaded again": lambda: copy.ring_all_reduce(t.clone()),
             "source exec'd": lambda: source["chunk_bounds"](8, 2),
             "pasted under another name": lambda: source["my_bounds"](8, 2),
             "its code renamed": lambda: renamed_code(8, 2),
             "backend below the process group": lambda: backend.allreduce([t.clone()]).wait(),
             "another torch collective": lambda: dist.all_gather_object([None] * world_size, 1)}
    for path, call in tries.items():  # one block each: a refusal ends its block too
        try:
            with unavailable("minidist.communication.comm.*", *TORCH_COLLECTIVES):
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
    """Refusal by code identity catches a module loaded again, exec'd source, a copy pasted under
    another name and the code object renamed; torch's backend under the process group is refused
    with dist.all_reduce, and TORCH_COLLECTIVES refuses every other collective; tampered_receives
    changes what a ring receives, so its result changes; recording keeps the tensor and what it
    held."""
    for found in run(_copies_backends_and_tampering, 3):
        wrong = {what: outcome for what, outcome in found.items()
                 if outcome not in ("refused", True)}
        assert not wrong, f"expected each refused or true: {found}"



def test_a_renamed_copy_is_refused_with_or_without_the_modules_future_import():
    """A function of a module with `from __future__ import annotations`, pasted under another
    name where that import is absent (or present), builds its annotations with other
    instructions: still refused."""
    from minidist.parallel import pipeline

    for future in ("", "from __future__ import annotations\n"):
        namespace = dict(vars(pipeline))
        source = inspect.getsource(pipeline._interleaved).replace("def _interleaved", "def copy")
        exec(compile(future + source, "<copy>", "exec", dont_inherit=True), namespace)
        with pytest.raises(LibraryVersionUsed, match="pipeline._interleaved: write your own"):
            with unavailable("minidist.parallel.pipeline._interleaved"):
                namespace["copy"](0, 2, 4, 2)
    assert len(pipeline._interleaved(0, 2, 4, 2)) == 16  # and it is back


def _recorded_below_torch_distributed(rank, world_size):
    from torch.distributed import distributed_c10d

    with recording() as calls:
        distributed_c10d.all_reduce(torch.ones(2))
        dist.all_gather_object([None] * world_size, rank)
    return [call.name for call in calls]


def test_recording_sees_distributed_c10d_and_torchs_own_callers():
    """A collective called as distributed_c10d's, and the all_gather inside all_gather_object,
    are recorded as dist's are."""
    for names in run(_recorded_below_torch_distributed, 2):
        assert names[0] == "all_reduce" and "all_gather" in names[1:], names


def _point_to_point_recorded(rank, world_size):
    token = torch.zeros(1)
    with recording() as calls:
        if rank == 0:
            dist.send(token, 1)
        else:
            dist.recv(token, 0)
    return [(call.name, call.peer) for call in calls]


def test_recording_records_a_send_once_though_torch_runs_it_through_isend():
    """dist.send runs isend (and recv irecv) inside: one call of the caller's, recorded once."""
    assert run(_point_to_point_recorded, 2) == [[("send", 1)], [("recv", 0)]]


def _store_refused_collectives_not(rank, world_size):
    from torch.distributed import distributed_c10d

    from minidist.core import agreement
    from minidist.core.refusal import TORCH_STORE

    found, store = {}, distributed_c10d._get_default_store()
    try:
        with agreement.unchecked(), unavailable(*TORCH_STORE):
            store.set(f"side channel {rank}", "1")
        found["store"] = "ran"
    except LibraryVersionUsed:
        found["store"] = "refused"
    with agreement.unchecked(), unavailable(*TORCH_STORE):
        total = torch.ones(2)
        dist.all_reduce(total)
    found["all_reduce"] = total.tolist()
    return found


def test_torch_store_refuses_the_rendezvous_store_and_leaves_collectives_alone():
    for found in run(_store_refused_collectives_not, 2):
        assert found == {"store": "refused", "all_reduce": [2.0, 2.0]}, found


def test_a_refused_class_refuses_through_an_alias_an_instance_and_a_property():
    """Refusing a class refuses every method it defines: an alias of the class taken before the
    block, an instance made before it and a property all meet the refusal; after it they work."""
    from minidist.jobs import tasks

    alias, made_before = tasks.Reversal, tasks.Reversal(digits=3)
    tries = {"an alias": lambda: alias(digits=3), "a method": lambda: made_before.held_out(4),
             "a property": lambda: made_before.answer}  # each one's refusal names Reversal
    for call in tries.values():
        with pytest.raises(LibraryVersionUsed, match="Reversal"):
            with unavailable("minidist.jobs.tasks.Reversal"):
                call()
    assert made_before.answer == slice(3, 6) and alias(digits=3).held_out(4)[0].shape == (4, 6)


def _stripped_clone(function: types.FunctionType, **changes) -> types.FunctionType:
    """`function`'s code under another name and place, without its docstring, its locals (but
    not its arguments) renamed."""
    code = function.__code__
    arguments = code.co_argcount + code.co_kwonlyargcount
    code = code.replace(**{"co_name": "mine", "co_qualname": "mine", "co_filename": "<cell>",
                           "co_firstlineno": 1, "co_consts": (None, *code.co_consts[1:]),
                           "co_varnames": code.co_varnames[:arguments] + tuple(
                               f"_{i}" for i in range(arguments, len(code.co_varnames))),
                           **changes})
    clone = types.FunctionType(code, function.__globals__, "mine", function.__defaults__)
    clone.__kwdefaults__ = function.__kwdefaults__
    return clone


def test_a_copy_is_refused_however_it_was_renamed_unless_it_is_short_and_written_anew():
    """A copy of the library's code is refused: a code object cloned under another name, place,
    docstring and locals, whether it keeps its line table (the library's layout), drops it (no
    compiled source lacks one) or, being long, anything else; the source pasted under another
    name without its docstring (the layout again). The same instructions of some length written
    anew (another layout) are the student's; long code, never."""
    from minidist.parallel import context_parallel, pipeline

    medium, long = context_parallel.chunks_of, pipeline._interleaved  # 47 and 99 instructions
    source = re.sub(r'(?s)\n[ \t]*""".*?"""', "", inspect.getsource(medium), count=1).replace(
        "def chunks_of", "def pasted")  # without its docstring
    namespace = dict(vars(context_parallel))
    exec(compile(source, "<cell>", "exec"), namespace)
    # The same instructions elsewhere: every line indented once more, a local renamed.
    anew = dict(vars(context_parallel))
    exec(compile("if True:\n" + "\n".join("    " + line for line in re.sub(
        r"\bcp_rank\b", "rank", source).splitlines()).replace("def pasted", "def anew"),
        "<cell>", "exec"), anew)
    copies = {"a clone keeping the layout": (medium, _stripped_clone(medium)),
              "a clone without a line table": (medium, _stripped_clone(medium, co_linetable=b"")),
              "a pasted copy": (medium, namespace["pasted"]),
              "a long clone placed anew": (long, _stripped_clone(long, co_firstlineno=7))}
    arguments = {medium: (1, 2), long: (0, 2, 4, 2)}
    for what, (original, copy) in copies.items():
        path = f"{original.__module__}.{original.__name__}"
        with pytest.raises(LibraryVersionUsed, match=f"{original.__name__}: write your own"):
            with unavailable(path):
                copy(*arguments[original], **({"layout": "zigzag"} if original is medium else {}))
                pytest.fail(f"{what} ran")
    expected = medium(1, 2, layout="zigzag")
    with unavailable("minidist.parallel.context_parallel.chunks_of"):
        assert anew["anew"](1, 2, layout="zigzag") == expected


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


def _start_a_process(how):
    import os
    import subprocess
    import sys
    from concurrent.futures import ProcessPoolExecutor

    if how == "subprocess":
        return subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout
    if how == "os.system":
        return os.system("true")
    if how == "process pool":
        with ProcessPoolExecutor(1) as pool:
            return pool.submit(abs, -1).result()
    if how == "minidist's run":
        return run(_reductions_and_all_to_alls, 1)
    try:  # a refusal caught and ignored is still one
        subprocess.run(["true"])
    except LibraryVersionUsed:
        pass
    return "went on"


@pytest.mark.parametrize("how", ["subprocess", "os.system", "process pool", "minidist's run",
                                 "caught"])
def test_unavailable_refuses_new_processes_when_asked(how):
    """processes=True: a fresh interpreter would reach the library out of the block's sight."""
    with pytest.raises(LibraryVersionUsed, match="started a process"):
        with unavailable("minidist.communication.comm.chunk_bounds", processes=True):
            _start_a_process(how)
    with unavailable("minidist.communication.comm.chunk_bounds"):  # not asked: allowed
        assert _start_a_process("os.system") == 0
    assert _start_a_process("os.system") == 0  # and allowed again after the block


def test_unavailable_refuses_a_c_method_however_it_is_bound():
    t = torch.arange(5)
    tries = {"method": lambda: t.tensor_split(2),
             "base class": lambda: torch._C.TensorBase.tensor_split(t, 2),
             "subclass": lambda: torch.nn.Parameter(t.float()).tensor_split(2)}
    for call in tries.values():
        with pytest.raises(LibraryVersionUsed, match="tensor_split"):
            with unavailable("torch.Tensor.tensor_split"):
                call()
    with unavailable("torch.Tensor.tensor_split"):
        t.chunk(2)  # another method still runs
    assert len(t.tensor_split(2)) == 2  # and the method again after the block


def _point_to_point_beside_refused_collectives(rank, world_size):
    # torch's collectives and its isend share one decorator's wrapper: refusing the ones must
    # not refuse the other by its code
    incoming = torch.zeros(2)
    with unavailable("torch.distributed.all_reduce", "torch.distributed.scatter_object_list"):
        requests = [dist.isend(torch.full((2,), float(rank)), 1 - rank),
                    dist.irecv(incoming, 1 - rank)]
        for request in requests:
            request.wait()
    return incoming.tolist()


def test_refusing_torch_collectives_leaves_point_to_point_alone():
    assert run(_point_to_point_beside_refused_collectives, 2) == [[1.0, 1.0], [0.0, 0.0]]


def _a_backend_call_refused(rank, world_size):
    from torch.distributed.distributed_c10d import _get_default_group

    backend = _get_default_group()._get_backend(torch.device("cpu"))
    try:  # torch's collectives, each refused with what runs below it (shared between them)
        with unavailable(*(f"{module}.{name}" for module in ("torch.distributed",
                                                            "torch.distributed.distributed_c10d")
                           for name in ("all_reduce", "all_gather", "all_gather_into_tensor",
                                        "all_gather_coalesced", "reduce_scatter_tensor"))):
            backend.allreduce([torch.ones(3)]).wait()
    except LibraryVersionUsed as error:
        return str(error)
    return "ran"


def test_a_refusal_names_the_function_called():
    """A function below two refused collectives is refused once: the message names it, not
    another refusal's path."""
    for said in run(_a_backend_call_refused, 2):
        assert "Backend.allreduce" in said, said


_SAVED_RING = None  # a code object kept from before a check, as a notebook cell could keep it


def _switches_the_watch_off():
    import sys

    sys.setprofile(None)
    return types.FunctionType(_SAVED_RING, {})


def _outside_the_watch(how):
    import queue
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    if how == "thread":
        handoff = queue.Queue()

        def serve():  # runs what it is handed, out of the check's thread
            handoff.get()
        thread = threading.Thread(target=serve)
        thread.start()
        return thread, lambda: (handoff.put(None), thread.join())
    if how == "pool":
        pool = ThreadPoolExecutor(1)
        pool.submit(abs, -1).result()
        return pool, pool.shutdown
    process = subprocess.Popen(["sleep", "30"])
    return process, lambda: (process.kill(), process.wait())


def _send_beside_the_process_group(rank, world_size, path):
    """What refusing FILES leaves: dist.send and dist.recv work; gloo's own send and receive
    below the process group and the dispatcher's c10d send on its boxed group (unseen by every
    count and tamper), and torch.from_file, refuse."""
    from minidist.core.refusal import FILES

    refused = []
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    message = torch.full((3,), float(rank))
    with unavailable(*FILES):
        if rank == 0:
            dist.send(message, 1)
        else:
            dist.recv(message, 0)
    c10d = torch.ops.c10d
    for attempt in (lambda: backend.send([message], 1 - rank, 7),
                    lambda: backend.recv([message], 1 - rank, 7),
                    lambda: torch.from_file(path, shared=True, size=3),
                    lambda: c10d.send([message], dist.group.WORLD.boxed(), 1 - rank, 8)):
        try:
            with unavailable(*FILES):
                attempt()
        except LibraryVersionUsed as error:
            refused.append("shares nothing through files" in str(error))
    return message.tolist(), refused


def test_files_refuse_the_backends_own_sends_and_shared_files(tmp_path):
    for message, refused in run(_send_beside_the_process_group, 2, str(tmp_path / "shared")):
        assert message == [0.0, 0.0, 0.0]  # the process group's send still travels
        assert refused == [True, True, True, True]
    assert not (tmp_path / "shared").exists()


def test_the_watch_cannot_be_switched_off_and_nothing_runs_beside_a_check():
    """A check's watch holds: switching its profile hook off is refused (and noticed if done
    unseen), a thread or a pool the notebook left running, or (processes=True) a child process,
    refuses the check at its start, and files are refused when asked, while a traceback's
    source lines still show."""
    import threading
    import traceback

    from minidist.core.refusal import FILES

    global _SAVED_RING
    _SAVED_RING = comm.ring_all_reduce.__code__
    from minidist.core import interposer

    def mute_tampering():
        with interposer.muted("tampering"):
            pass

    for switch_off in (_switches_the_watch_off, lambda: threading.setprofile(None),
                       mute_tampering):
        with pytest.raises(LibraryVersionUsed, match="switch off the check's watch"):
            with unavailable("minidist.communication.comm.*"):
                switch_off()
    with pytest.raises(LibraryVersionUsed, match="comm.ring_all_reduce"):
        with unavailable("minidist.communication.comm.*"):  # the saved original, hook on
            types.FunctionType(_SAVED_RING, comm.ring_all_reduce.__globals__)(None, None, None)
    for how, processes in (("thread", False), ("pool", False), ("process", True)):
        running, stop = _outside_the_watch(how)
        try:
            with pytest.raises(LibraryVersionUsed, match="still running beside the check"):
                with unavailable("minidist.communication.comm.chunk_bounds", processes=processes):
                    pass
        finally:
            stop()
        with unavailable("minidist.communication.comm.chunk_bounds", processes=processes):
            pass  # once it has finished, the check runs
    with pytest.raises(LibraryVersionUsed, match="shares nothing through files"):
        with unavailable(*FILES):
            with open("/dev/null", "w"):
                pass
    with unavailable(*FILES):
        try:
            raise ValueError("shown")
        except ValueError:
            shown = traceback.format_exc()
    assert 'raise ValueError("shown")' in shown, f"the traceback should quote its line: {shown}"


def test_minidist_own_idle_communication_thread_does_not_refuse_a_check():
    """minidist's communication thread (collectives.in_background's pool) outlives the
    collective that started it: idle, it does not refuse the next check; with work queued on
    it, it does, as any pool does."""
    import threading

    from minidist.communication import collectives

    collectives.in_background(lambda: None).result()
    with unavailable("minidist.communication.comm.chunk_bounds"):
        pass
    release = threading.Event()
    busy = collectives.in_background(release.wait)
    try:
        with pytest.raises(LibraryVersionUsed, match="still running beside the check"):
            with unavailable("minidist.communication.comm.chunk_bounds"):
                pass
    finally:
        release.set()
        busy.result()


def _received_in_flight_and_tampered(rank, world_size):
    import time

    from minidist.core.checking import in_flight, ran_while_in_flight

    found = {}
    with in_flight() as records:
        incoming = torch.full((4,), float("nan"))
        requests = [dist.isend(torch.full((4,), float(rank)), (rank + 1) % world_size),
                    dist.irecv(incoming, (rank - 1) % world_size)]
        time.sleep(0.2)  # the message has landed by now; the caller must not see it yet
        found["nothing before the wait"] = bool(torch.isnan(incoming).all())
        torch.ones(2, 2) @ torch.ones(2, 2)
        for request in requests:
            request.wait()
        found["the message after it"] = incoming.tolist() == [float((rank - 1) % world_size)] * 4
    found["the matmul ran in flight"] = ran_while_in_flight(records) == {0: 1, 1: 1}
    with tampered_receives(delta=1.0, scale=-2.0):
        received = torch.zeros(3)
        if rank == 0:
            dist.send(torch.full((3,), 5.0), 1)
        else:
            dist.recv(received, 0)
    found["scaled then shifted"] = rank == 0 or received.tolist() == [-9.0] * 3
    alone = dist.new_group([0])
    with recording() as calls:
        dist.all_reduce(torch.ones(1))
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=alone)
    found["each call's group"] = [c.ranks for c in calls] == [(0, 1), (0,)][:2 - rank]
    return found


def test_in_flight_hands_a_message_over_at_its_wait_and_tampering_scales():
    """in_flight holds what arrives until the wait (polling the buffer shows nothing early);
    tampered_receives(scale=...) moves a result that adds what arrived to one made elsewhere;
    recording names the ranks of each collective's group."""
    for found in run(_received_in_flight_and_tampered, 2):
        assert all(found.values()), f"expected each true: {found}"


def test_holding_refuses_a_thread_whose_memory_it_would_not_count():
    import threading

    from minidist.core.checking import holding

    with pytest.raises(LibraryVersionUsed, match="started a thread"):
        with holding():
            threading.Thread(target=torch.ones, args=(1000,)).start()


def test_holding_sees_the_most_held_at_once_and_what_a_kept_view_keeps():
    from minidist.core.checking import holding

    with holding() as held:
        first = torch.empty(1000)  # 4,000 bytes
        second = torch.empty(2000)  # 8,000 more: 12,000 at once
        del first
        third = torch.empty(500)
        del second, third
    assert held.peak_bytes == 12_000 and held.nbytes == 0, (
        f"expected 12,000 bytes at most and none left; got {held.peak_bytes}, {held.nbytes}")
    with holding() as held:
        kept = torch.zeros(100)[:10]  # a view: the other 90 elements stay allocated beside it
    assert held.new_bytes(exclude=[kept]) == 360, (
        f"excluding the view leaves its own 40 bytes out, not its allocation's 400: expected "
        f"360 held, got {held.new_bytes(exclude=[kept])}")


def test_plain_converts_what_would_compute_later_inside_the_block():
    """A float whose value asks the library when it is compared: plain() makes it ask now,
    inside the block, where the library refuses; a liar's comparisons are left behind."""
    from minidist.core.checking import plain
    from minidist.costs import cost

    class Later(float):
        def __float__(self):
            return float(cost.all_reduce_time("ring", 1000, 2, 1e-5, 1e-9))

    class Liar(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    with pytest.raises(LibraryVersionUsed, match="all_reduce_time"):
        with unavailable("minidist.costs.cost.*"):
            plain(Later(0.0))
    with unavailable("minidist.costs.cost.*"):
        found = plain({"tp": Liar(3), "terms": [Liar(1), (2.5, "s")], "t": torch.ones(2)})
    assert found["tp"] != 4 and type(found["tp"]) is int and found["terms"] == [1, (2.5, "s")]
    assert type(found["t"]) is torch.Tensor


def test_an_edited_copy_is_refused_and_the_solutions_are_not_copies():
    """A copy of the library's code compiled from its source with a line added is refused by
    what it keeps of the original's columns; code written in a cell is not compared (it may
    hold scaffolding the lab shares with the library)."""
    import textwrap

    from minidist.jobs import profiling

    lines = textwrap.dedent(inspect.getsource(profiling.merge)).split("\n")
    lines.insert(3, " " * (len(lines[3]) - len(lines[3].lstrip())) + "_unused = 0")
    namespace = dict(vars(profiling))
    exec(compile("\n".join(lines), "<mine>", "exec"), namespace)
    with pytest.raises(LibraryVersionUsed, match="profiling.merge"):
        with unavailable("minidist.jobs.profiling.merge"):
            namespace["merge"]([(0.0, 1.0), (0.5, 2.0)])

    def union(intervals):  # an honest merge of intervals, as a student writes it
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    with unavailable("minidist.jobs.profiling.merge"):
        assert union([(0.0, 1.0), (0.5, 2.0)]) == [(0.0, 2.0)]


def test_work_handed_to_the_library_thread_is_watched_as_the_caller_is():
    """minidist's communication thread runs what it is handed under the caller's watch: a copy
    of refused code handed to it inside a check is refused there too."""
    from minidist.communication.collectives import in_background

    in_background(lambda: None).result()  # the thread exists before the check
    saved = comm.ring_all_reduce.__code__
    with pytest.raises(LibraryVersionUsed, match="ring_all_reduce"):
        with unavailable("minidist.communication.comm.*"):
            in_background(lambda: types.FunctionType(saved, {})(None, None, None)).result()


def test_a_library_name_rebound_inside_a_check_is_refused_and_put_back():
    """A student's function that rebinds the library's reference (the check would compare with
    the stand-in) is refused; a spy the check bound before its block stays."""
    from minidist.costs import planner

    original = planner.estimate_time

    def stand_in(*args, **kwargs):
        return 0.0

    with pytest.raises(LibraryVersionUsed, match=r"minidist\.costs\.planner\.estimate_time "
                                                 r"was rebound inside the check"):
        with unavailable("minidist.costs.planner.estimate_memory"):
            planner.estimate_time = stand_in
    assert planner.estimate_time is original, "put back at the block's end"
    with pytest.raises(LibraryVersionUsed, match="was rebound inside the check"):
        with unavailable("minidist.costs.planner.estimate_memory"):
            with unavailable("minidist.costs.planner.plan"):  # leaves it to the outer block
                planner.estimate_time = stand_in
    assert planner.estimate_time is original, "put back as the outer block ends"
    planner.estimate_time = stand_in
    try:
        with unavailable("minidist.costs.planner.estimate_memory"):
            pass
        assert planner.estimate_time is stand_in
    finally:
        planner.estimate_time = original


def test_detached_keeps_imports_and_own_code_but_not_what_the_notebook_computed():
    """A table or fitted constant an earlier cell made with the library is out of reach of the
    detached function; its imports, its own helpers and builtins are not."""
    import math

    from minidist.core.checking import detached

    notebook = {"__name__": "__main__"}
    exec("import math\nfrom minidist.core.checking import plain\n"
         "_FIT = 3.0\n_TABLE = {(2, 3): 0.25}\n"
         "def helper(p):\n    return math.sqrt(p)\n"
         "def honest(p, m):\n    return helper(p) * m + len([p])\n"
         "def fitted(p, m):\n    return _FIT * p\n"
         "def looked_up(p, m, table=_TABLE):\n    return table[p, m]\n"
         "def via_main(p, m):\n    import __main__\n    return __main__._FIT\n"
         "def outer():\n    fit = _FIT\n"
         "    def inner(p, m):\n        return fit\n    return inner\n"
         "closed = outer()\n", notebook)
    import builtins
    builtins._STASHED_BY_A_CELL = 1.0  # a name added to builtins later is state too
    try:
        exec("def stashed(p, m):\n    return _STASHED_BY_A_CELL\n", notebook)
        assert detached(notebook["honest"], notebook)(4, 3) == 2.0 * 3 + 1
        assert detached(notebook["honest"], notebook)(4, 3) == notebook["honest"](4, 3)
        for name in ("fitted", "stashed"):
            with pytest.raises(NameError):
                detached(notebook[name], notebook)(2, 3)
        with pytest.raises(TypeError):  # a default argument is a value computed outside the code
            detached(notebook["looked_up"], notebook)(2, 3)
        with pytest.raises(ImportError):
            detached(notebook["via_main"], notebook)(2, 3)
        with pytest.raises(AssertionError, match="top level"):
            detached(notebook["closed"], notebook)
        with pytest.raises(AssertionError, match="defined in its cell"):
            detached(math.sqrt, notebook)
    finally:
        del builtins._STASHED_BY_A_CELL


def test_detached_keeps_literal_defaults_and_the_notebooks_classes():
    """An honest function's `eps=1e-6` and its own helper class survive detaching; a default
    computed by an earlier cell and a table kept on a class do not."""
    import linecache

    from minidist.core.checking import detached

    source = ("_FIT = 3.0\n"
              "class Span:\n"
              "    TABLE = list(range(100))\n"
              "    def __init__(self, start, end):\n"
              "        self.start, self.end = start, end\n"
              "    @property\n"
              "    def length(self):\n"
              "        return self.end - self.start\n"
              "def honest(p, m, eps=1e-6, *, scale=2):\n"
              "    return Span(p, m).length * scale + eps\n"
              "def fitted(p, m, fit=_FIT):\n"
              "    return fit * p\n"
              "def tabled(p, m):\n"
              "    return Span.TABLE[p]\n"
              "class Wider(Span):\n"
              "    def __init__(self, start, end, *, by=1):\n"
              "        super().__init__(start - by, end + by)\n"
              "def widened(p, m):\n"
              "    return Wider(p, m).length\n")
    filename = "<notebook cell: test_detached_keeps_literal_defaults>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    notebook = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), notebook)
    assert detached(notebook["honest"], notebook)(1, 4) == 3 * 2 + 1e-6
    # a subclass calling super(), its literal keyword default kept
    assert detached(notebook["widened"], notebook)(1, 4) == 5
    with pytest.raises(TypeError):  # a default from an earlier cell's value: state
        detached(notebook["fitted"], notebook)(2, 3)
    with pytest.raises(AttributeError):  # a table kept on a class: state
        detached(notebook["tabled"], notebook)(2, 3)


def test_peeking_at_the_check_is_refused_to_the_notebooks_code():
    """Inside a check, the notebook's own code (here: this file's) cannot read the check's
    frames, list live objects, or talk through a descriptor opened before the check; the
    library's code still can (a logger finds its caller's frame)."""
    import gc
    import logging
    import socket

    reader, writer = os.pipe()
    os.write(writer, b"xy")
    mine, theirs = socket.socketpair()
    theirs.send(b"z")
    try:
        for peek in (lambda: sys._getframe(1).f_locals, gc.get_objects,
                     lambda: __import__("inspect").currentframe(),
                     lambda: os.read(reader, 1), lambda: mine.recv(1)):
            with pytest.raises(LibraryVersionUsed, match="not from the check's frames"):
                with unavailable("minidist.communication.comm.chunk_bounds"):
                    peek()
        with unavailable("minidist.communication.comm.chunk_bounds"):
            logging.getLogger("minidist.test").findCaller()  # logging's own sys._getframe
    finally:
        for end in (reader, writer):
            os.close(end)
        mine.close()
        theirs.close()


def test_a_helper_detached_before_the_check_is_refused():
    """A process forked before the check and detached from it (a double fork, a new session),
    which still has the library and shares a pipe with the notebook, refuses the check."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the helper: a grandchild in its own session, holding both ends
        if os.fork() == 0:
            os.setsid()
            time.sleep(30)
        os._exit(0)
    os.waitpid(child, 0)
    try:
        with pytest.raises(LibraryVersionUsed, match="shares a pipe or memory with your notebook"):
            with unavailable("minidist.communication.comm.chunk_bounds"):
                pass
    finally:
        helpers = _strangers()
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
        os.close(reader)
        os.close(writer)
    assert len(helpers) == 1, f"expected the one helper, found {helpers}"
    deadline = time.monotonic() + 10
    while _strangers() and time.monotonic() < deadline:  # until it is gone
        time.sleep(0.05)
    with unavailable("minidist.communication.comm.chunk_bounds"):
        pass  # gone: the next check runs


def test_only_a_process_that_may_descend_from_the_notebook_is_read():
    """A helper detached from the notebook is adopted by init or by one of the notebook's own
    ancestors; a process another, older lineage started (another notebook's rank) cannot be
    the notebook's, and its descriptors are left unread."""
    # pid: (parent, start time). 1 init; 10 the server, 20 the notebook (born at 200); 30 a
    # sibling notebook started before it; 40 its rank, started after the notebook.
    processes = {1: (0, 0), 10: (1, 100), 20: (10, 200), 30: (10, 150), 40: (30, 300),
                 50: (1, 310),  # a helper the notebook double-forked: adopted by init
                 60: (10, 320),  # one adopted by the server (an ancestor that adopts orphans)
                 70: (80, 330), 80: (20, 325),  # a helper's child, its parent still the helper
                 90: (30, 140)}  # older than the notebook: never its
    lineage = {1, 10, 20}
    may = {pid for pid in processes if pid not in lineage
           and _may_descend(pid, processes, lineage, born=200)}
    assert may == {50, 60, 70, 80}, may


def test_a_block_inside_a_block_that_refuses_files_still_starts():
    """A check nested in one that refuses files looks for helpers in /proc as it starts: its
    own reading is not the checked function's."""
    from minidist.core.refusal import FILES

    with unavailable("minidist.communication.comm.chunk_bounds", *FILES):
        with unavailable("minidist.communication.comm.ring_all_reduce", processes=True):
            pass


def test_torch_load_runs_unwatched_only_where_it_can_run_nothing_but_torchs_code(tmp_path):
    """Inside a block torch.load of tensors from a path runs with the copy-detecting hook off
    (its Python unpickler made a restore four times slower); a file-like object of the
    caller's, a class of the caller's allowed in the load, or a callable map_location keeps the
    hook on (their code runs inside the load), and so does a block that refuses files, inside
    one that does not too (only the innermost block's hook watches)."""
    from minidist.communication import comm
    from minidist.core.refusal import FILES

    source = {}
    exec(compile(inspect.getsource(comm.chunk_bounds), "<copy>", "exec"), source)
    path = tmp_path / "tensors.pt"
    torch.save({"weight": torch.ones(3)}, path)

    class Reading(io.BytesIO):
        def read(self, *args):
            source["chunk_bounds"](8, 2)  # a copy of the refused function, inside the load
            return super().read(*args)

    def allowing_kept():
        with torch.serialization.safe_globals([Kept]):
            return torch.load(tmp_path / "kept.pt")

    def placing(storage, location):
        source["chunk_bounds"](8, 2)
        return storage

    torch.save({"weight": torch.ones(3), "kept": Kept()}, tmp_path / "kept.pt")
    Kept.copied = source["chunk_bounds"]
    original = torch.load
    with unavailable("minidist.communication.comm.chunk_bounds"):
        assert torch.load is not original and torch.load.__wrapped__ is original
        assert torch.load(path)["weight"].tolist() == [1.0, 1.0, 1.0]
    assert torch.load is original and torch.serialization.load is original
    for watched in (lambda: torch.load(Reading(path.read_bytes())),
                    lambda: torch.load(path, map_location=placing), allowing_kept):
        with pytest.raises(LibraryVersionUsed, match="chunk_bounds"):
            with unavailable("minidist.communication.comm.chunk_bounds"):
                watched()
    with unavailable("minidist.communication.comm.chunk_bounds"):
        unwatched = torch.load
        with unavailable("minidist.communication.comm.chunk_bounds", *FILES):
            assert torch.load is original  # files refused: the loader keeps its watch
        assert torch.load is unwatched
    assert torch.load is original and torch.serialization.load is original


class Kept:
    """A class of the caller's that a weights-only load may build once allowed in: its
    __setstate__ runs `copied`, a copy of a refused function (test above)."""

    copied = None

    def __init__(self):
        self.size = 3  # some state, or pickle never calls __setstate__

    def __setstate__(self, state):
        if Kept.copied is not None:
            Kept.copied(8, 2)
        self.__dict__.update(state)


def _tampered_out_of_sight(rank, world_size):
    """The tamper's numbers: not seen by a torch-function mode or a patched tensor method of the
    receiving code; secret offsets differ between ranks and are handed to the check; a tensor
    subclass sent is recorded as a plain tensor."""
    from torch.overrides import TorchFunctionMode

    from minidist.core.checking import messages_sent

    class Spy(TorchFunctionMode):
        seen: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("mul_", "add_"):
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    class Agrees(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.equal:
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    offsets, message = [], torch.zeros(2)
    patched, calls = torch.Tensor.add_, []
    def counted_add(self, *args, **kwargs):
        calls.append(1)
        return patched(self, *args, **kwargs)

    torch.Tensor.add_ = counted_add
    try:
        with tampered_receives(delta=1.0, scale=2.0, secret_offsets=offsets), Spy() as spy, \
                messages_sent() as sent:
            if rank == 0:
                dist.send(torch.ones(2).as_subclass(Agrees), 1)
            else:
                dist.recv(message, 0)
    finally:
        torch.Tensor.add_ = patched
    payload = sent[0].payload if sent else None
    return (spy.seen, calls, offsets, message.tolist(), type(payload).__name__,
            payload is not None and torch.equal(payload, torch.full((2,), 7.0)))


def test_tampering_is_out_of_the_receivers_sight_and_secret_offsets_differ():
    sender, receiver = run(_tampered_out_of_sight, 2)
    seen, calls, offsets, message, _, _ = receiver
    assert seen == [] and calls == [], f"the tamper's arithmetic was seen: {seen}, {calls}"
    assert len(offsets) == 1 and offsets[0] == int(offsets[0]) and -1000 <= offsets[0] <= 1000
    assert message == [3.0 + offsets[0]] * 2, f"expected 2 x 1 + 1 + the offset, got {message}"
    *_, kind, lies = sender
    assert kind == "Tensor" and not lies, "a subclass sent is recorded as a plain tensor"


def test_reached_buffers_finds_what_a_function_keeps_beside_its_arguments():
    from minidist.core.checking import reached_buffers

    pool = torch.zeros(1 << 16)
    table = {n: [n] for n in range(1000)}

    def helper():
        return pool[:2] + table[0][0]

    def keeps():
        return helper()

    def honest(x):
        return x * 2

    keeps.cache = torch.zeros(4096)
    found = [name for name, _ in reached_buffers(keeps)]
    assert found == ["helper.pool", "helper.table", "keeps.cache"], found
    assert reached_buffers(honest) == []


def test_foreign_memory_is_refused_where_holding_cannot_count_it():
    import numpy as np

    from minidist.core.refusal import FOREIGN_MEMORY

    with pytest.raises(LibraryVersionUsed, match="from_numpy"):
        with unavailable(*FOREIGN_MEMORY):
            torch.from_numpy(np.zeros(10))
