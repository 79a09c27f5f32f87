"""The local Slurm cluster and the course's job scripts, run for real (root only).

cluster.sh brings up munge, slurmctld and two slurmd "nodes" in their own network namespaces;
the job scripts in cluster_setup/jobs run unchanged on it with BACKEND=gloo.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_fixtures import CLUSTER_SH, JOBS_DIR, NODES, REPO

pytestmark = [pytest.mark.xdist_group("cluster")]

RANK_LINE = re.compile(
    r"^allreduce rank=(\d+)/(\d+) node=(\S+) local_rank=(\d+) backend=(\w+) "
    r"sum=(\S+) expected=(\S+) (ok|WRONG)$",
    re.M,
)


def test_shellcheck_passes_on_every_cluster_script():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), (
        f"{shellcheck} is missing: pip install -r cluster_setup/requirements-admin.txt"
    )
    scripts = sorted(
        path for pattern in ("*.sh", "*.sbatch") for path in (REPO / "cluster_setup").rglob(pattern)
    )
    assert {path.name for path in scripts} >= {
        "cluster.sh", "env.sh", "common.sh", "torchrun.sbatch", "srun_ranks.sbatch",
        "lab.sbatch", "validate.sbatch",
    }
    result = subprocess.run(
        [str(shellcheck), "--external-sources", *map(str, scripts)],
        cwd=REPO, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_cluster_is_up_with_two_gpu_nodes(local_cluster):
    sinfo = local_cluster.run("sinfo", "--noheader", "--Node", "--format=%N %T %G").stdout
    assert sinfo.split("\n")[:2] == [f"{node} idle gpu:2" for node in NODES], sinfo
    shown = {node: local_cluster.run("scontrol", "show", "node", node).stdout for node in NODES}
    addresses = {node: re.search(r"NodeAddr=(\S+)", text)[1] for node, text in shown.items()}
    assert addresses == {"gpu01": "10.213.7.11", "gpu02": "10.213.7.12"}
    # Rendered from the Ansible templates, for this machine's hostname.
    conf = (local_cluster.state_dir / "etc" / "head" / "slurm.conf").read_text()
    hostname = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert "Ansible managed" in conf
    assert f"SlurmctldHost={hostname}(10.213.7.1)" in conf


def test_up_again_says_it_is_up(local_cluster):
    result = subprocess.run(
        [str(CLUSTER_SH), "up"], env=local_cluster.env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "already up" in result.stdout


def test_ordinary_users_run_jobs(local_cluster):
    result = local_cluster.run("runuser", "-u", "nobody", "--", "srun", "--nodes=2", "id", "-un")
    assert result.stdout.split() == ["nobody", "nobody"], result.stderr


# How long a job may take to finish: a bound on waiting, not a speed. Four ranks importing torch
# on 2 cores beside 4 busy processes and the rest of the suite once took over 90 s.
JOB_LIMIT_S = 300

@pytest.mark.parametrize(
    ("script", "env"),
    [("srun_ranks.sbatch", {}), ("torchrun.sbatch", {"NPROC_PER_NODE": "2"})],
)
def test_job_scripts_all_reduce_on_two_nodes_by_two_ranks(local_cluster, script, env):
    sbatch_args = ("--nodes=2", "--ntasks-per-node=2") if script == "srun_ranks.sbatch" else ()
    job = local_cluster.sbatch(
        JOBS_DIR / script, sbatch_args=sbatch_args, env={"BACKEND": "gloo", **env},
        timeout=JOB_LIMIT_S,
    )
    assert job.state == "COMPLETED", job.output
    ranks = {int(m[0]): m for m in RANK_LINE.findall(job.output)}
    assert sorted(ranks) == [0, 1, 2, 3], job.output
    placement = set()
    for _, world_size, node, local_rank, backend, total, expected, verdict in ranks.values():
        assert (world_size, backend, total, expected, verdict) == ("4", "gloo", "10", "10", "ok")
        placement.add((node, local_rank))
    # Two ranks on each node (torchrun numbers the nodes in the order they join).
    assert placement == {(node, local) for node in NODES for local in ("0", "1")}, job.output


@pytest.mark.parametrize(("gpus", "visible"), [(1, "0"), (2, "0,1")])
def test_gpus_per_node_sets_cuda_visible_devices(local_cluster, gpus, visible):
    result = local_cluster.run(
        "srun", "--nodes=2", f"--gpus-per-node={gpus}", "printenv", "CUDA_VISIBLE_DEVICES"
    )
    assert result.stdout.split() == [visible, visible], result.stderr


def test_wrong_network_interface_fails_fast_and_says_why(local_cluster):
    job = local_cluster.sbatch(
        JOBS_DIR / "srun_ranks.sbatch", env={"BACKEND": "gloo", "NETWORK_INTERFACE": "nosuch0"},
        timeout=30,
    )
    assert job.state == "FAILED", job.output
    assert job.seconds < 10, f"took {job.seconds:.1f} s"
    for node in NODES:
        assert (
            f"NETWORK_INTERFACE=nosuch0 does not exist on node {node} (its interfaces: lo sl0)"
            in job.output
        ), job.output
    assert "allreduce rank=" not in job.output


def test_validation_job_prints_busbw_and_fails_below_the_threshold(local_cluster):
    job = local_cluster.sbatch(
        JOBS_DIR / "validate.sbatch",
        env={"BACKEND": "gloo", "MAX_MIB": "1", "MIN_BUSBW_GBPS": "1000"}, timeout=JOB_LIMIT_S,
    )
    assert job.state == "FAILED", job.output
    assert re.search(r"busbw torch all_reduce 1 MiB on 4 ranks \(gloo\): \d+\.\d+ GB/s", job.output)
    assert re.search(r"busbw check: \S+ GB/s vs minimum 1000 GB/s: FAIL", job.output), job.output


def test_a_running_job_is_left_for_down_to_stop(local_cluster):
    """The session's teardown (cluster.sh down) must stop this job and its step too."""
    job_id = local_cluster.run(
        "runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--nodes=2", "--output=/dev/null",
        "--wrap", "srun sleep 600",
    ).stdout.strip()
    deadline = time.monotonic() + 20
    while local_cluster.job_fields(job_id).get("JobState") != "RUNNING":
        assert time.monotonic() < deadline, local_cluster.job_fields(job_id)
        time.sleep(0.1)


def test_the_capstone_job_runs_unchanged_under_slurm(local_cluster, tmp_path):
    """Lab 14's my_job.py, as the solution writes it, under torchrun.sbatch on two nodes of two
    ranks (dp 2, pp 2): the same losses as one process, within 1e-5."""
    import torch
    from test_capstone import one_process_losses, write_capstone_files

    folder = tmp_path / "capstone"
    folder.mkdir()
    folder.chmod(0o777)
    files = write_capstone_files(folder)
    result = folder / "slurm.pt"
    job = local_cluster.sbatch(
        JOBS_DIR / "torchrun.sbatch", str(files["my_job.py"]), "--dp", "2", "--pp", "2",
        "--microbatches", "2", "--steps", "3", "--eval-every", "100",
        "--pieces", str(files["my_pieces.py"]), "--result", str(result),
        env={"BACKEND": "gloo", "NPROC_PER_NODE": "2"}, timeout=JOB_LIMIT_S,
    )
    assert job.state == "COMPLETED", job.output
    under_slurm = torch.load(result, weights_only=False)["losses"]
    expected = one_process_losses(3)
    assert sorted(under_slurm) == [1, 2, 3], job.output
    gaps = [abs(under_slurm[step + 1] - want) for step, want in enumerate(expected)]
    assert max(gaps) <= 1e-5, f"losses under Slurm {under_slurm}, one process {expected}"
