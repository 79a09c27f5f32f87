import json
import multiprocessing.util
import os
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

pytest_plugins = ["cluster_fixtures"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, keep the tests that share an expensive fixture on one worker, so that
    it is built once: each lab's grading tests (generate, autograde, the hanging submission),
    and a module's tests that use one of its module-scoped fixtures (launches of many ranks).
    A test already placed in a group by its own mark stays there."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "lab" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"lab-{callspec.params['lab']}"))
        elif any(definitions[-1].scope == "module"
                 for definitions in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # Longest first (with --no-loadscope-reorder, pyproject.toml): xdist hands each worker the
    # next group in this order, so the last groups to start are short ones, not a lab's
    # grading that would run alone at the end while the other workers idle.
    items.sort(key=lambda item: LONGEST_FIRST.index(group) if (group := group_of(item))
               in LONGEST_FIRST else len(LONGEST_FIRST))


# The groups that take minutes, longest first (measured under the suite's own load: the
# capstone's grading trains its model several times; the cluster's tests share one Slurm, hub
# and network namespace set-up).
LONGEST_FIRST = [
    "lab-14_capstone", "cluster", "lab-04_zero_fsdp", "lab-03_data_parallel",
    "lab-12_memory_beyond_the_gpu", "lab-06_pipeline", "lab-01_collectives",
    "lab-07_3d_parallel", "lab-13_long_context", "lab-08_profiling", "lab-05_tensor_parallel",
    "lab-11_nodes_and_links", "lab-10_beyond_allreduce", "lab-02_memory_math",
    "lab-09_fault_tolerance", "lab-00_first_ranks", "classroom", "self_grade", "jupyterlab",
]


def group_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With SCALING_LAB_TIMELINE=path, each test's worker, group, start and end (epoch seconds)
    and CPU seconds are appended to that file, one JSON line per test: what ran beside what,
    which group kept one worker busy at the end (LONGEST_FIRST's order comes from it), and what
    the suite's CPU goes to (on 2 cores its time is its CPU over 2). The CPU counts this worker
    and the processes it waited for, theirs included (a notebook's kernel, its fork server and
    ranks), in the test whose set-up or body ran them."""
    start, cpu = time.time(), cpu_seconds()
    yield
    if path := os.environ.get("SCALING_LAB_TIMELINE"):
        with open(path, "a") as timeline:
            timeline.write(json.dumps({
                "test": item.nodeid, "group": group_of(item), "start": start, "end": time.time(),
                "cpu": cpu_seconds() - cpu,
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


def cpu_seconds() -> float:
    return sum(sum(resource.getrusage(who)[:2])
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A module that drives a browser with Playwright in this process leaves asyncio's default
    executor behind, its thread ('asyncio_0') idle. minidist's checks refuse to run beside a
    pool's thread (it runs whatever it is handed, out of the check's sight), so a later test of
    a check on the same worker would fail for it: shut such pools down as a module's last test
    is torn down (its own tests may still use the pool). A hook, not an autouse fixture: a
    module-scoped fixture would keep every module's tests on one worker (see above)."""
    if nextitem is not None and nextitem.module is item.module:
        return
    for thread in threading.enumerate():
        owner = getattr(thread, "_args", None)
        if thread.name.startswith("asyncio_") and owner and callable(owner[0]):
            executor = owner[0]()  # ThreadPoolExecutor hands its workers a weak reference
            if executor is not None:
                executor.shutdown(wait=True)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_one_folder() -> Iterator[None]:
    """Whatever the tests and the processes they start write to the temporary folder
    (torchrun's logs, ranks' scratch folders) goes into one folder of this worker's, removed
    when the worker exits (after the local cluster's teardown), so the suite leaves /tmp as
    it found it. Writable by all, as /tmp is: jobs run as the course's test users write there
    too."""
    folder = tempfile.mkdtemp(prefix="scaling-lab-tests-")
    os.chmod(folder, 0o1777)
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    yield
    if before[0] is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]
    # Removed at exit, after multiprocessing has removed its own folder in it (exit priority
    # -100), which this worker's fork servers keep till then.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,),
                                  kwargs={"ignore_errors": True}, exitpriority=-101)
