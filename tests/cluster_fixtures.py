"""The local Slurm cluster (cluster_setup/local/cluster.sh) as a pytest fixture.

`local_cluster` (session scope, root only) brings the cluster up once, hands the tests a
`LocalCluster` to submit jobs with, and at the end of the session brings it down and asserts
that nothing it made is left: no daemon, job process, namespace, link, port or state directory.
Where the tests do not run as root it skips them and says why.

Tests that use it carry `pytestmark = [pytest.mark.xdist_group("cluster")]`, so that under
xdist they all run on one worker and share one cluster.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / "cluster_setup" / "local" / "cluster.sh"
ENV_SH = REPO / "cluster_setup" / "local" / "env.sh"
JOBS_DIR = REPO / "cluster_setup" / "jobs"
NODES = ("gpu01", "gpu02")
PORTS = (6817, 6818)  # slurmctld, slurmd
LOCK_FILE = "/tmp/scalinglab-cluster.lock"
LOCK_WAIT_S = 900
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
}


@dataclass
class Job:
    id: str
    state: str
    exit_code: str
    seconds: float  # from submission until the job reached its final state
    output: str


class LocalCluster:
    """The running local cluster: its environment (env.sh's) and helpers to run jobs."""

    def __init__(self, env: dict[str, str], output_dir: Path, up_output: str):
        self.env = env
        self.up_output = up_output  # what `cluster.sh up` printed
        self.state_dir = Path(env["SCALINGLAB_CLUSTER_DIR"])
        self.output_dir = output_dir

    def run(self, *args: str, timeout: float = 30, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a command (srun, squeue, ...) against the cluster; output is captured as text."""
        return subprocess.run(
            args, env={**self.env, **(env or {})}, capture_output=True, text=True,
            timeout=timeout, check=check,
        )

    def submit(self, script: str | Path, *script_args: str, sbatch_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> str:
        """sbatch a script; its output goes to output_dir/<job id>.out. Returns the job id."""
        result = self.run(
            "sbatch", "--parsable", f"--output={self.output_dir}/%j.out", *sbatch_args,
            str(script), *script_args, env=env,
        )
        return result.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float = 60, submitted: float | None = None) -> Job:
        """Wait for a job to end (polling: sbatch --wait polls only every few seconds)."""
        start = time.monotonic() if submitted is None else submitted
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in TERMINAL_STATES:
                break
            if time.monotonic() - start > timeout:
                self.run("scancel", job_id, check=False)
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(0.1)
        seconds = time.monotonic() - start
        output_file = self.output_dir / f"{job_id}.out"
        output = output_file.read_text() if output_file.exists() else ""
        return Job(job_id, fields["JobState"], fields.get("ExitCode", ""), seconds, output)

    def sbatch(self, script: str | Path, *script_args: str, sbatch_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, timeout: float = 60) -> Job:
        """Submit a job and wait for it to end."""
        submitted = time.monotonic()
        job_id = self.submit(script, *script_args, sbatch_args=sbatch_args, env=env)
        return self.wait(job_id, timeout, submitted)


def run_ok(*args: str | Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output if it fails."""
    command = [str(a) for a in args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}{result.stderr}"
    return result


def wait_for(predicate, timeout: float, what: str, every: float = 0.3):
    """Poll `predicate` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def cluster_env() -> dict[str, str]:
    """This process's environment, with what env.sh exports and no Slurm job's variables."""
    dump = subprocess.run(
        ["bash", "-c", f'source "{ENV_SH}" && env -0'], capture_output=True, check=True
    ).stdout.decode()
    env = dict(item.split("=", 1) for item in dump.split("\0") if "=" in item)
    return {
        name: value for name, value in env.items()
        if not name.startswith("SLURM_") or name == "SLURM_CONF"
    }


def leftovers(state_dir: Path, namespaces: set[str]) -> list[str]:
    """What a stopped local cluster should not have left behind, described.

    namespaces: the nodes' network namespaces as /proc/PID/ns/net names them ("net:[inode]");
    a process still in one (a job's, say) outlives the namespace's name.
    """
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            namespace = os.readlink(proc / "ns" / "net")
        except OSError:
            continue
        if cmdline and (str(state_dir) in cmdline or namespace in namespaces):
            found.append(f"process {proc.name}: {cmdline}")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"namespace {line.split()[0]}" for line in namespaces.splitlines()
              if line.startswith("sl-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [f"link {name}" for name in re.findall(r"^\d+: ([^:@]+)", links, re.M)
              if name == "slbr0" or name.startswith("slv-")]
    listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    found += [f"listening port {port}" for port in PORTS
              if re.search(rf":{port}\s", listening)]
    if state_dir.exists():
        found.append(f"state directory {state_dir}")
    return found


def _cluster_sh(command: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [str(CLUSTER_SH), command], env=env, capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(f"cluster.sh {command} failed ({result.returncode}):\n{output}")
    return output


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory) -> LocalCluster:
    if os.geteuid() != 0:
        pytest.skip(
            "the local Slurm cluster needs root (it starts munge, slurmctld and slurmd and makes "
            "network namespaces); run the tests as root to run these, as CI does"
        )
    for tool in ("ip", "apt-get"):
        if shutil.which(tool) is None:
            pytest.skip(f"the local Slurm cluster needs {tool} (a Debian-like system)")
    env = cluster_env()
    # The cluster's names (bridge, namespaces, ports) are fixed: two test sessions on one
    # machine take turns instead of tearing down each other's cluster.
    lock = open(LOCK_FILE, "w")  # held, and so locked, for the whole session
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"another test session held {LOCK_FILE} for {LOCK_WAIT_S} s")
            time.sleep(1)
    # A cluster left from an earlier run may have an older configuration: start afresh.
    _cluster_sh("down", env)
    up_output = _cluster_sh("up", env)
    namespaces = {f"net:[{Path('/run/netns', f'sl-{node}').stat().st_ino}]" for node in NODES}
    output_dir = tmp_path_factory.mktemp("slurm-jobs")
    output_dir.chmod(0o1777)  # jobs of other users write their output here too
    cluster = LocalCluster(env, output_dir, up_output)
    yield cluster
    try:
        _cluster_sh("down", env)
        left = leftovers(cluster.state_dir, namespaces)
        assert not left, "cluster.sh down left these behind:\n" + "\n".join(left)
    finally:
        lock.close()
