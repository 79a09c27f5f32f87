"""minidist.core.launch: results, output, failures, hangs, interrupts, and no process left
behind."""

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from minidist.core.launch import RankError, RankTimeout, default_backend, run

REPO = Path(__file__).resolve().parents[1]
# A failure is reported by its own mechanism (a death, a mismatch, a cycle), never by waiting for
# the run's timeout, which these tests set far above this bound; the bound leaves room for a
# machine busy with the rest of the suite, so it catches a hang, not a slow report.
REPORTED_WITHIN_S = 20
DEATH_REPORTED_WITHIN_S = 5  # from the moment a rank dies to the error in the caller


def square_after_all_reduce(rank, world_size, offset):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"sum of ranks is {total.item():g}")
    return rank * rank + offset, total.item()


def raise_on_rank_two(rank, world_size):
    if rank == 2:
        raise ValueError("rank two is broken")
    dist.all_reduce(torch.ones(4))  # the peers block here until rank 2's connection breaks
    return rank


def rank_zero_waits_forever(rank, world_size):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    return rank


def descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def rank_processes() -> set[int]:
    """Our ranks: the children of the fork server this test process started (other test workers
    run ranks of their own at the same time)."""
    pids = set()
    for server in psutil.Process().children():
        try:
            if "forkserver" in " ".join(server.cmdline()):
                pids |= {child.pid for child in server.children()}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def wait_until_gone(pids: set[int], seconds: float) -> dict[int, str]:
    """The processes among `pids` still running after `seconds` (pid: command line)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = {}
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive[pid] = " ".join(process.cmdline())[:120]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, **kwargs,
    )


def test_results_come_back_in_rank_order_and_output_is_prefixed(capfd):
    results = run(square_after_all_reduce, 4, 10)
    assert results == [(10, 6.0), (11, 6.0), (14, 6.0), (19, 6.0)]
    out = capfd.readouterr().out
    for rank in range(4):
        assert f"[rank{rank}] sum of ranks is 6" in out


def listening_ports(table: str) -> set[int]:
    """The ports listening (TCP state 0A) in /proc/net/tcp or tcp6."""
    rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
    return {int(row.split()[1].rsplit(":", 1)[1], 16) for row in rows if row.split()[3] == "0A"}


def rendezvous_seen(rank, world_size):
    """What a rank sees of its rendezvous: the store's port, where it listens, the resolver's
    options; and a line torch prints when a name lookup fails, which the caller drops."""
    port = int(os.environ["MASTER_PORT"])
    print("[W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. "
          "err=-3", file=sys.stderr)
    print("a line of its own", file=sys.stderr)
    options = os.environ["RES_OPTIONS"]
    return port in listening_ports("tcp"), port in listening_ports("tcp6"), options


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_rendezvous_store_listens_on_ipv4_and_lookups_wait_one_second(capfd):
    """torch's store names each socket it connects or accepts by asking DNS (for its logs); an
    IPv4 peer is named by /etc/hosts, and a lost answer costs a second, not glibc's five."""
    assert run(rendezvous_seen, 2) == [(True, False, "timeout:1 attempts:2")] * 2
    err = capfd.readouterr().err
    assert "a line of its own" in err and "cannot be retrieved" not in err, err


def test_one_rank_and_keyword_arguments():
    def scaled(rank, world_size, *, scale):
        return scale * (rank + 1)

    assert run(scaled, 1, scale=3) == [3]


def test_function_defined_in_python_dash_c_runs_on_four_ranks():
    done = python("""
        import torch, torch.distributed as dist
        from minidist.core.launch import run

        class Point:  # a class that exists only in this script
            def __init__(self, x):
                self.x = x

        def gather_ranks(rank, world_size):
            t = torch.tensor([rank])
            out = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
            dist.all_gather(out, t)
            print("hello from", rank)
            return Point([int(x) for x in out])

        print([p.x for p in run(gather_ranks, 4)])
    """)
    assert done.returncode == 0, done.stderr
    assert "[[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]" in done.stdout
    assert "[rank3] hello from 3" in done.stdout


def test_script_without_main_guard_is_not_re_run_by_ranks(tmp_path):
    script = tmp_path / "lab.py"
    script.write_text("from minidist.core.launch import run\n"
                      "print('top', run(lambda r, n: r, 2))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top") == 1


def test_failing_rank_is_named_with_its_traceback_and_peers_are_killed():
    warm_fork_server()
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run(raise_on_rank_two, 4, timeout=120)
    assert time.monotonic() - start < REPORTED_WITHIN_S
    error = caught.value
    assert error.rank == 2
    assert "rank 2 of 4 failed: ValueError: rank two is broken" in str(error)
    assert 'raise ValueError("rank two is broken")' in str(error)
    assert "failed too" not in str(error)  # the others only broke because rank 2 stopped
    assert not isinstance(error, RankTimeout)
    assert wait_until_gone(rank_processes(), 5) == {}


def raise_on_every_rank(rank, world_size):
    raise NotImplementedError("write this exercise")


def test_ranks_that_fail_on_their_own_are_each_reported_as_such():
    with pytest.raises(RankError) as caught:
        run(raise_on_every_rank, 3)
    message = str(caught.value)
    first = caught.value.rank
    assert message.startswith(f"rank {first} of 3 failed: NotImplementedError: write this exercise"
                              f"\n\nTraceback from rank {first}:\n")
    assert 'raise NotImplementedError("write this exercise")' in message
    for other in {0, 1, 2} - {first}:
        assert (f"rank {other} of 3 failed too, on its own, with the same error and traceback."
                in message)
    assert "afterwards" not in message
    assert "minidist/core/launch.py" not in message
    assert "minidist/core/_supervisor.py" not in message


def test_rank_that_dies_without_an_exception_is_named():
    def exit_hard(rank, world_size):
        if rank == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankError, match="rank 1 of 2 failed: the process exited with code 3"):
        run(exit_hard, 2)


def test_stuck_rank_is_named_with_where_it_was_stuck():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        run(rank_zero_waits_forever, 2, timeout=2)
    assert time.monotonic() - start < 2 + REPORTED_WITHIN_S
    assert caught.value.ranks == [0]
    message = str(caught.value)
    assert "rank(s) 0 of 2 did not finish within 2 s (rank(s) 1 finished)" in message
    line = line_of(rank_zero_waits_forever, "dist.recv")
    assert (f'rank 0 is in recv of 1 float32 from rank 1 at File "{__file__}", line {line} (in '
            "rank_zero_waits_forever), waiting for rank 1, which already returned") in message
    assert "in rank_zero_waits_forever" in message
    assert wait_until_gone(rank_processes(), 5) == {}


def abort_after_a_marker(rank, world_size):
    if rank == 1:
        print(f"dying at {time.monotonic()}", flush=True)  # one clock for every process
        print("malloc(): unaligned tcache chunk detected", file=sys.stderr, flush=True)
        os.abort()  # as glibc does when it finds the heap corrupted
    dist.barrier()


def warm_fork_server() -> None:
    """Start this process's fork server (its first run imports torch there, seconds on a busy
    machine), so that a timed run measures the report, not that start."""
    run(lambda rank, world_size: None, 1)


def test_native_death_shows_its_stderr_its_stack_and_what_the_message_means(capfd):
    with pytest.raises(RankError) as caught:
        run(abort_after_a_marker, 2, timeout=120)
    reported = time.monotonic()
    output = capfd.readouterr()
    died = float(re.search(r"dying at ([\d.]+)", output.out)[1])
    assert reported - died < DEATH_REPORTED_WITHIN_S
    message = str(caught.value)
    assert message.startswith("rank 1 of 2 failed: the process was killed by SIGABRT before "
                              "returning\nglibc found the heap corrupted"), message
    assert "untyped_storage().resize_(n)" in message
    assert ("Last lines rank 1 wrote to stderr:\n  malloc(): unaligned tcache chunk detected"
            in message)
    assert (f'Python stack of rank 1 when it died (most recent call last):\n  File "{__file__}", '
            f"line {abort_after_a_marker.__code__.co_firstlineno + 4}, in abort_after_a_marker\n"
            "    os.abort()") in message
    assert "(rank(s) 0 failed afterwards, because rank(s) 1 stopped" in message
    assert "Fatal Python error" not in output.err, "faulthandler's dump is the report's"


def all_gather_different_sizes(rank, world_size):
    mine = torch.ones(64 if rank == 0 else 32)
    dist.all_gather([torch.zeros_like(mine) for _ in range(world_size)], mine)


def reduce_or_broadcast(rank, world_size):
    x = torch.ones(8)
    if rank == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)


def line_of(fn, text: str) -> int:
    """The line number of the line of `fn` that holds `text`."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_size_mismatch_that_crashes_names_both_ranks_calls():
    warm_fork_server()
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run(all_gather_different_sizes, 2, timeout=120)
    assert time.monotonic() - start < REPORTED_WITHIN_S
    message = str(caught.value)
    line = line_of(all_gather_different_sizes, "dist.all_gather")
    assert "the process was killed by SIGABRT" in message
    assert "a collective mismatch" in message
    assert (f'Mismatched calls: rank 0 called all_gather of 64 float32 at File "{__file__}", line '
            f"{line} (in all_gather_different_sizes); rank 1 called all_gather of 32 float32 at "
            f'File "{__file__}", line {line} (in all_gather_different_sizes).') in message


def test_different_collectives_that_hang_are_named_within_seconds():
    warm_fork_server()
    start = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        run(reduce_or_broadcast, 2, timeout=120)
    assert time.monotonic() - start < REPORTED_WITHIN_S, "expected them stopped before the timeout"
    message = str(caught.value)
    assert message.startswith("rank(s) 0, 1 of 2 are stuck in mismatched collectives: stopped "
                              "after 2 s without progress (the timeout was 120 s)"), message
    reduce_line = line_of(reduce_or_broadcast, "dist.all_reduce")
    broadcast_line = line_of(reduce_or_broadcast, "dist.broadcast")
    assert (f'Mismatched calls: rank 0 called all_reduce of 8 float32 at File "{__file__}", line '
            f"{reduce_line} (in reduce_or_broadcast); rank 1 called broadcast of 8 float32 from "
            f'root 0 at File "{__file__}", line {broadcast_line} (in reduce_or_broadcast).'
            ) in message
    assert "Where rank 0 was stuck" in message and "Where rank 1 was stuck" in message
    assert "distributed_c10d.py" not in message, "torch's frames should be hidden"
    assert caught.value.ranks == [0, 1]


RECV_CYCLE = """
    import time, torch, torch.distributed as dist
    from minidist.core.launch import RankTimeout, run

    def everyone_receives_first(rank, world_size):
        token = torch.zeros(1)
        dist.recv(token, src=(rank - 1) % world_size)
        dist.send(token, dst=(rank + 1) % world_size)

    run(lambda rank, world_size: None, 1)  # the fork server starts once per program
    start = time.monotonic()
    try:
        run(everyone_receives_first, {world_size}, timeout={timeout})
    except RankTimeout as error:
        print(f"after {{time.monotonic() - start:.1f}} s:")
        print(error)
"""


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_recv_cycle_is_named_as_a_cycle_with_one_stack_and_a_live_line(world_size):
    timeout = 15  # the live line shows after 5 s without progress, however slowly ranks start
    # Bytes: text mode would turn the live line's carriage returns into newlines.
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RECV_CYCLE).format(
        world_size=world_size, timeout=timeout)], capture_output=True, timeout=120)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.split()[1])
    assert seconds < timeout + 5, done.stdout
    last = world_size - 1
    hops = "".join(f"{r} for {r - 1}, " for r in range(last, 1, -1))
    assert f"Deadlock: rank 0 waits for {last}, {hops}1 for 0: nobody sends first." in \
        done.stdout, done.stdout
    assert f'ranks 0–{last} are all at File "<string>", line 7\n' in done.stdout, done.stdout
    assert done.stdout.count("in everyone_receives_first") == 1, "identical stacks shown once"
    assert "Where rank 0 was stuck" not in done.stdout
    assert "distributed_c10d.py" not in done.stdout and "MINIDIST_FULL_STACKS" in done.stdout
    # The live line, drawn after a carriage return while nothing moved, then wiped.
    line = f"still waiting after 5 s: ranks 0–{last} in recv"
    assert done.stderr.startswith(f"\r{line}"), repr(done.stderr)
    assert re.search(rf"\r {{{len(line)},}}\r$", done.stderr), repr(done.stderr)


def test_full_stacks_on_request(monkeypatch):
    monkeypatch.setenv("MINIDIST_FULL_STACKS", "1")
    with pytest.raises(RankTimeout) as caught:
        run(rank_zero_waits_forever, 2, timeout=2)
    assert "distributed_c10d.py" in str(caught.value)
    assert "MINIDIST_FULL_STACKS" not in str(caught.value)


def send_and_receive_in_a_batch(rank, world_size):
    """P2POp checks its op is torch's own dist.isend: recording must leave it so."""
    outgoing, incoming = torch.full((2,), float(rank)), torch.zeros(2)
    ops = [dist.P2POp(dist.isend, outgoing, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return incoming[0].item()


def test_recorded_calls_leave_torchs_point_to_point_api_as_it_was():
    assert run(send_and_receive_in_a_batch, 3) == [2.0, 0.0, 1.0]


def reduce_different_shapes(rank, world_size):
    dist.all_reduce(torch.zeros(4 if rank == 0 else 8))  # a bug: the ranks disagree on the size


def test_variables_set_after_the_first_run_reach_the_ranks_and_detail_names_a_mismatch(
        monkeypatch):
    run(square_after_all_reduce, 1, 0)  # the fork server starts here, before the variable is set
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run(reduce_different_shapes, 2, timeout=120)
    message = str(caught.value)
    assert time.monotonic() - start < REPORTED_WITHIN_S, "expected it caught before the timeout"
    for expected in ("Detected mismatch between collectives", "Rank 0 is running collective",
                     "Rank 1 is running collective", "TensorShape=[4]", "TensorShape=[8]",
                     "Mismatched calls: rank 0 called all_reduce of 4 float32",
                     "rank 1 called all_reduce of 8 float32"):
        assert expected in message, f"expected {expected!r} in the report, got:\n{message}"


def test_many_runs_in_a_row_and_two_programs_at_once():
    program = """
        from minidist.core.launch import run
        import torch, torch.distributed as dist
        def total(rank, world_size):
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        for _ in range(10):
            assert run(total, 3) == [3.0] * 3
        print("ok")
    """
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(program)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip().endswith("ok")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_interrupt_or_killed_caller_leaves_no_rank_behind(how):
    program = """
        import time
        from minidist.core.launch import run
        def sleep_forever(rank, world_size):
            print("started", flush=True)
            time.sleep(600)
        run(sleep_forever, 3, timeout=600)
    """
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(program)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = 0
    while started < 3:
        line = caller.stdout.readline()
        assert line, caller.stderr.read()
        started += "started" in line
    ranks = {p.pid for p in psutil.Process(caller.pid).children(recursive=True)}
    assert len(ranks) >= 4  # the fork server and three ranks
    caller.send_signal(how)
    caller.wait(timeout=REPORTED_WITHIN_S)
    if how == signal.SIGINT:
        stderr = caller.stderr.read()
        assert stderr.rstrip().endswith("RunInterrupted: all 3 ranks were stopped")
        assert "selectors.py" not in stderr and "_supervisor.py" not in stderr
    assert wait_until_gone(ranks, REPORTED_WITHIN_S) == {}


def test_in_a_notebook_errors_show_cells_and_an_interrupt_says_the_ranks_stopped(tmp_path):
    """What a student sees in Jupyter: a rank's frames as "Cell In[n], line k", none of the
    launcher's frames, and, after an interrupt, one line saying the ranks were stopped."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "from minidist.core.launch import run",
        "def exercise(rank, world_size):\n    raise NotImplementedError('write this exercise')",
        "run(exercise, 2)",
        "import time\n\ndef slow(rank, world_size):\n    time.sleep(120)\n\n"
        "run(slow, 2, timeout=300)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
        # The last cell is interrupted, as a student would, once its ranks are running.
        timeout_func=lambda cell: 15 if "slow" in cell.source else 120,
        resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    error, interrupt = (notebook.cells[i].outputs[-1] for i in (2, 3))

    assert error.output_type == "error" and error.ename == "RankError"
    first = int(error.evalue.split()[1])  # "rank 1 of 2 failed: ..."
    assert f"Traceback from rank {first}:\n  Cell In[2], line 2, in exercise\n" in error.evalue
    assert f"rank {1 - first} of 2 failed too, on its own" in error.evalue
    assert "afterwards" not in error.evalue
    assert error.traceback[0] == f"RankError: rank {first} of 2 failed: NotImplementedError: " \
                                 "write this exercise"
    shown = "\n".join(error.traceback)
    for hidden in ("minidist/core/launch.py", "minidist/core/_supervisor.py", "ipykernel_",
                   "selectors.py"):
        assert hidden not in shown

    assert interrupt.output_type == "error" and interrupt.ename == "RunInterrupted"
    assert interrupt.traceback == ["RunInterrupted: all 2 ranks were stopped"]


def test_a_kernel_that_ran_ranks_shuts_down_by_itself(tmp_path):
    """Shutting down or restarting a kernel that started ranks: the fork server and
    multiprocessing's resource tracker (which ignores SIGTERM) are stopped with the kernel, so
    it exits on its own instead of being terminated by the client after its grace period (a
    wait at every restart, and after every notebook nbgrader runs)."""
    jupyter_client = pytest.importorskip("jupyter_client")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    # A kernel kept alive by its helpers never exits; one tearing torch down on a busy machine
    # takes seconds: the client's grace (5 s by default) is long enough to tell them apart.
    manager.shutdown_wait_time = 60
    manager.start_kernel(cwd=str(tmp_path))
    kernel = manager.provisioner.process
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        code = ("from minidist.core.launch import run\n"
                "def rank_of(rank, world_size):\n    return rank\n"
                "assert run(rank_of, 2) == [0, 1]")
        reply = client.execute_interactive(code, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        helpers = psutil.Process(kernel.pid).children()
        assert len(helpers) == 2, [helper.cmdline() for helper in helpers]  # server, tracker
    finally:
        client.stop_channels()
        manager.shutdown_kernel()
    assert kernel.returncode == 0, (
        f"the kernel should exit by itself; it ended with {kernel.returncode} (-15: terminated "
        f"by the client after waiting for its children)")
    assert not [helper for helper in helpers if helper.is_running()]


def test_in_a_notebook_a_crash_and_a_deadlock_name_cells_and_a_live_line_comes_and_goes(
        tmp_path):
    """What a student sees in Jupyter when a rank dies natively (its stderr, its stack as
    "Cell In[n]" frames, what the message means) and when ranks wait on each other in a cycle
    (the cycle, one stack for all, a live line while they wait that the report replaces)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "import os, sys, time\nimport torch, torch.distributed as dist\n"
        "from minidist.core.launch import run\n"
        "run(lambda rank, world_size: None, 1)  # the kernel's fork server starts here",
        "def crash(rank, world_size):\n"
        "    if rank == 1:\n"
        "        print(f'dying at {time.monotonic()}', flush=True)\n"
        "        print('malloc(): unaligned tcache chunk detected', file=sys.stderr, flush=True)\n"
        "        os.abort()\n"
        "    dist.barrier()",
        "try:\n    run(crash, 2)\nfinally:\n    reported = time.monotonic()",
        "def ring(rank, world_size):\n"
        "    token = torch.zeros(1)\n"
        "    dist.recv(token, src=(rank - 1) % world_size)\n"
        "    dist.send(token, dst=(rank + 1) % world_size)",
        "started = time.monotonic()\ntry:\n    run(ring, 4, timeout=15)\n"
        "finally:\n    hang_seconds = time.monotonic() - started",
        "print(reported, hang_seconds)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    displays = []

    class Recording(nbclient.NotebookClient):
        def process_message(self, msg, cell, cell_index):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                displays.append(msg["content"]["data"].get("text/plain", ""))
            return super().process_message(msg, cell, cell_index)

    client = Recording(notebook, kernel_name="python3", allow_errors=True, timeout=120,
                       resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    crash, hang = (notebook.cells[i].outputs[-1] for i in (2, 4))
    reported, hang_seconds = map(float, notebook.cells[5].outputs[0].text.split())
    died = float(re.search(r"dying at ([\d.]+)", notebook.cells[2].outputs[0].text)[1])

    assert crash.output_type == "error" and crash.ename == "RankError"
    shown = "\n".join(crash.traceback)
    assert reported - died < DEATH_REPORTED_WITHIN_S
    assert shown.startswith("RankError: rank 1 of 2 failed: the process was killed by SIGABRT "
                            "before returning\nglibc found the heap corrupted"), shown
    assert "  malloc(): unaligned tcache chunk detected" in shown
    assert ("Python stack of rank 1 when it died (most recent call last):\n"
            "  Cell In[2], line 5, in crash\n    os.abort()") in shown

    assert hang.output_type == "error" and hang.ename == "RankTimeout"
    shown = "\n".join(hang.traceback)
    assert hang_seconds < 15 + 5
    assert "Deadlock: rank 0 waits for 3, 3 for 2, 2 for 1, 1 for 0: nobody sends first." in shown
    assert ("ranks 0–3 are all at Cell In[4], line 3: dist.recv(token, src=(rank - 1) % "
            "world_size)\nWhere ranks 0–3 were stuck (most recent call last):\n"
            "  Cell In[4], line 3, in ring\n") in shown, shown
    assert "ipykernel_" not in shown and "distributed_c10d" not in shown
    assert "still waiting after 5 s: ranks 0–3 in recv" in displays, displays
    assert displays[-1] == "", "the live line should be replaced by the report"
    live = [o for o in notebook.cells[4].outputs if o.output_type == "display_data"]
    assert [o.data["text/plain"] for o in live] == [""], live


def test_torchrun_runs_the_same_code_in_place(tmp_path):
    script = tmp_path / "lab.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from minidist.core.launch import run
        def total(rank, world_size):
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            return rank, t.item()
        print(f"results {run(total, 2)}", flush=True)
    """))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--standalone", str(script)]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("results [(0, 3.0), (1, 3.0)]") == 2

    wrong = [*torchrun[:3], "--nproc-per-node=3", *torchrun[4:]]
    done = subprocess.run(wrong, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "run(..., world_size=2) but this job has 3 processes" in done.stderr


def test_an_in_place_job_frees_its_groups_before_python_shuts_down(tmp_path):
    """A gloo worker thread still alive at interpreter shutdown can abort a rank that has
    finished ("terminate called without an active exception", about 1 run in 20 on a busy
    machine): by the time Python shuts down, no group's threads may be left. What keeps a
    group alive: minidist's per-group state (a ring, a counted collective, a Mesh's declared
    network) and functions that capture the default group when torch.optim first imports
    them."""
    script = tmp_path / "lab.py"
    script.write_text(textwrap.dedent("""
        import atexit, os
        # Registered first, so it runs after run()'s own exit handler has left the group.
        def threads():
            return sorted(open(f"/proc/self/task/{task}/comm").read().strip()
                          for task in os.listdir("/proc/self/task"))
        # One write per line, so the two ranks' lines cannot interleave.
        atexit.register(lambda: print(f"threads at shutdown: {threads()}", flush=True))
        import torch
        from minidist.communication import collectives
        from minidist.core.launch import run
        from minidist.communication.mesh import Mesh
        from minidist.communication.network import TwoTier
        from minidist.communication.counting import count_traffic
        def step(rank, world_size):
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
            Mesh(dp=2, network=TwoTier(ranks_per_node=1))
            with count_traffic():
                collectives.all_reduce(torch.ones(8), impl="ring")
            return rank
        run(step, 2)
    """))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--standalone", str(script)]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("threads at shutdown: ['python']") == 2, done.stdout


def unused_port_below_the_ephemeral_range() -> int:
    """A port no one listens on now, below the range the kernel hands out to outgoing
    connections: srun's tasks are told one by MASTER_PORT, and a port in that range (one a pid
    gave, say) can be taken by any connection on the machine before the store listens on it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    for port in random.Random().sample(range(20000, ephemeral), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port between 20000 and {ephemeral}")


def test_slurm_srun_environment_runs_in_place(tmp_path):
    """What `srun -n 2 python lab.py` gives each task (without a Slurm cluster here)."""
    script = tmp_path / "lab.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from minidist.core.launch import run
        def total(rank, world_size):
            t = torch.tensor([10.0 ** rank])
            dist.all_reduce(t)
            return t.item()
        print(f"results {run(total, 2)}", flush=True)
    """))
    port = str(unused_port_below_the_ephemeral_range())
    tasks = []
    for rank in range(2):
        env = {
            **os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }
        tasks.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for task in tasks:
        out, err = task.communicate(timeout=60)
        assert task.returncode == 0, err
        assert "results [11.0, 11.0]" in out


def test_one_task_slurm_job_still_starts_its_own_ranks(monkeypatch):
    """A notebook in a one-task Slurm job (JupyterHub's SlurmSpawner) is not a rank."""
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
                        "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert run(square_after_all_reduce, 2, 0) == [(0, 1.0), (1, 1.0)]


def test_minidist_backend_sets_the_default(monkeypatch):
    monkeypatch.setenv("MINIDIST_BACKEND", "gloo")
    assert default_backend(4) == "gloo"
    monkeypatch.setenv("MINIDIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="MINIDIST_BACKEND='mpi': use 'gloo' or 'nccl'"):
        run(square_after_all_reduce, 2, 1)


def test_bad_arguments_are_explained_before_any_rank_starts():
    before = rank_processes()
    with pytest.raises(ValueError, match="world_size=0: must be a positive integer"):
        run(square_after_all_reduce, 0, 1)
    with pytest.raises(ValueError, match="world_size=-2: must be a positive integer"):
        run(square_after_all_reduce, -2, 1)

    def no_world_size(rank):
        return rank

    with pytest.raises(ValueError) as caught:
        run(no_world_size, 2)
    assert ("no_world_size(rank) cannot be called as no_world_size(rank, world_size): too many "
            "positional arguments") in str(caught.value)
    assert "define it as def no_world_size(rank, world_size, ...)" in str(caught.value)
    with pytest.raises(ValueError, match=r"cannot be called as square_after_all_reduce\(rank, "
                                         r"world_size\): missing a required argument: 'offset'"):
        run(square_after_all_reduce, 2)
    with pytest.raises(ValueError, match="run's first argument must be a function, got 4"):
        run(4, 2)
    for bad in (0, -1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match=rf"timeout={bad!r}: must be a positive, finite "
                                             r"number of seconds .* e\.g\. timeout=30"):
            run(square_after_all_reduce, 2, 1, timeout=bad)
    assert rank_processes() <= before, "a rank started before the arguments were checked"
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        run(square_after_all_reduce, 2, 1, backend="mpi")
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        if torch.cuda.device_count() >= 64:
            pytest.skip("this machine has 64 GPUs")
        run(square_after_all_reduce, 64, 1, backend="nccl")
    with pytest.raises(ValueError, match="cannot send"):
        run(square_after_all_reduce, 2, (x for x in range(3)))


def _rank_of(rank: int, world_size: int) -> int:
    return rank


def test_a_refused_launch_leaves_no_calls_file_and_no_rank():
    """A launch refused inside a check (starting processes refused) frees what it had made:
    the calls file in /dev/shm, and no rank outlives it."""
    from minidist.core.refusal import LibraryVersionUsed, unavailable

    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(LibraryVersionUsed, match="started a process"):
        with unavailable(processes=True):
            run(_rank_of, 2)
    left = set(shm.iterdir()) - before if shm.is_dir() else set()
    assert not [path for path in left if path.name.startswith("minidist-calls-")]
    started = {child.pid for child in psutil.Process().children(recursive=True)} - children
    alive = [pid for pid in started if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
             and "forkserver" not in " ".join(psutil.Process(pid).cmdline())]
    assert not alive, f"ranks left running: {alive}"
    assert run(_rank_of, 2) == [0, 1]  # and the next launch works
