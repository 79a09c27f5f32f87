"""The cluster's Ansible: it lints, the site playbook parses, and render.yml renders the Slurm and
JupyterHub configuration from the inventory, idempotently. No root needed: everything is rendered
into temporary directories over a local connection."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.xdist_group("cluster")]

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "cluster_setup" / "ansible"
BIN = Path(sys.executable).parent


def _run(
    args: list[str], cwd: Path, tmp_path: Path, path: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess:
    """Run an Ansible tool from the test's venv; `path` goes first on PATH."""
    if not (BIN / args[0]).exists():
        pytest.fail(f"{BIN / args[0]} is missing: install cluster_setup/requirements-admin.txt")
    env = {
        **os.environ,
        # ansible-lint finds ansible-playbook on PATH.
        "PATH": os.pathsep.join([*map(str, path), str(BIN), os.environ.get("PATH", "")]),
        # Keep Ansible's caches and temporary files out of the home directory.
        "ANSIBLE_HOME": str(tmp_path / "ansible_home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible_tmp"),
        "ANSIBLE_REMOTE_TEMP": str(tmp_path / "ansible_remote_tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{output}"
    return output


def _recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    recap = {}
    for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.MULTILINE):
        recap[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
    return recap


def _local_inventory(tmp_path: Path) -> Path:
    """A head node and two GPU nodes of different sizes, each rendering into its own directory
    (as each real node has its own /etc), all over a local connection."""
    out = str(tmp_path / "out")
    node = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "vars": {
                "slurm_conf_dir": out + "/{{ inventory_hostname }}/slurm",
                "jupyterhub_conf_dir": out + "/{{ inventory_hostname }}/jupyterhub",
                "course_env_jupyter_dir": out + "/{{ inventory_hostname }}/jupyter",
                "course_env_exchange_dir": out + "/exchange",
                "slurm_partitions": [
                    {"name": "gpu", "default": True, "max_time": "8:00:00", "nodes": "ALL"},
                    {"name": "big", "default": False, "max_time": "1:00:00", "nodes": "gpu02"},
                ],
                "jupyterhub_gres": "gpu:2",
            },
            "children": {
                "slurm_controller": {"hosts": {"head": {**node, "ansible_host": "10.9.0.1"}}},
                "jupyterhub": {"hosts": {"head": None}},
                "slurm_compute": {
                    "hosts": {
                        "gpu01": {
                            **node,
                            "slurm_node_addr": "10.9.0.11",
                            "slurm_cpus": 4,
                            "slurm_memory_mb": 2000,
                            "slurm_gpus": 2,
                            "slurm_gpu_files": "/tmp/fake/gpu01/nvidia[0-1]",
                        },
                        "gpu02": {
                            **node,
                            "slurm_node_addr": "10.9.0.12",
                            "slurm_cpus": 8,
                            "slurm_memory_mb": 4000,
                            "slurm_gpus": 4,
                            "slurm_gpu_files": "/tmp/fake/gpu02/nvidia[0-3]",
                        },
                    }
                },
                "gpu_nodes": {"children": {"slurm_compute": None}},
            },
        }
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def test_ansible_lint_passes(tmp_path: Path) -> None:
    proc = _run(["ansible-lint", "--offline", "--nocolor"], ANSIBLE_DIR, tmp_path)
    output = _check(proc)
    assert "Profile 'production' was required, and it passed" in output, output


def test_site_playbook_syntax(tmp_path: Path) -> None:
    # From the playbook directory, so ansible.cfg (roles path, example inventory) is used.
    proc = _run(["ansible-playbook", "--syntax-check", "site.yml"], ANSIBLE_DIR, tmp_path)
    _check(proc)


def test_render_writes_configs_and_is_idempotent(tmp_path: Path) -> None:
    inventory = _local_inventory(tmp_path)
    # As the local cluster runs it: from the repository root, without this directory's ansible.cfg.
    cmd = ["ansible-playbook", "-i", str(inventory), "cluster_setup/ansible/render.yml"]
    first = _recap(_check(_run(cmd, ROOT, tmp_path)))
    assert set(first) == {"head", "gpu01", "gpu02"}, first
    assert all(c["failed"] == 0 and c["changed"] > 0 for c in first.values()), first

    out = tmp_path / "out"
    slurm_conf = (out / "head" / "slurm" / "slurm.conf").read_text()
    lines = slurm_conf.splitlines()
    assert "ClusterName=scalinglab" in lines
    assert "SlurmctldHost=head(10.9.0.1)" in lines
    assert "GresTypes=gpu" in lines
    assert "ProctrackType=proctrack/cgroup" in lines
    assert (
        "NodeName=gpu01 NodeAddr=10.9.0.11 CPUs=4 RealMemory=2000 Gres=gpu:2 State=UNKNOWN"
    ) in lines
    assert (
        "NodeName=gpu02 NodeAddr=10.9.0.12 CPUs=8 RealMemory=4000 Gres=gpu:4 State=UNKNOWN"
    ) in lines
    partitions = [line for line in lines if line.startswith("PartitionName=")]
    assert partitions == [
        "PartitionName=gpu Nodes=ALL Default=YES MaxTime=8:00:00 State=UP",
        "PartitionName=big Nodes=gpu02 Default=NO MaxTime=1:00:00 State=UP",
    ]

    gres = (out / "head" / "slurm" / "gres.conf").read_text().splitlines()
    assert "NodeName=gpu01 Name=gpu File=/tmp/fake/gpu01/nvidia[0-1]" in gres
    assert "NodeName=gpu02 Name=gpu File=/tmp/fake/gpu02/nvidia[0-3]" in gres

    cgroup = (out / "head" / "slurm" / "cgroup.conf").read_text().splitlines()
    for setting in ("ConstrainDevices=yes", "ConstrainCores=yes", "ConstrainRAMSpace=yes"):
        assert setting in cgroup

    # Every node gets the same Slurm configuration; only the hub host gets the hub's.
    for name in ("slurm.conf", "gres.conf", "cgroup.conf"):
        for node in ("gpu01", "gpu02"):
            rendered = (out / node / "slurm" / name).read_text()
            assert rendered == (out / "head" / "slurm" / name).read_text(), (node, name)
    assert not (out / "gpu01" / "jupyterhub").exists()

    hub = (out / "head" / "jupyterhub" / "jupyterhub_config.py").read_text()
    assert 'c.SlurmSpawner.req_gres = "gpu:2"' in hub
    assert '"gpu01": "10.9.0.11"' in hub and '"gpu02": "10.9.0.12"' in hub
    compile(hub, "jupyterhub_config.py", "exec")  # valid Python
    assert f'"students": "{out}/head/jupyter/students"' in hub

    # nbgrader's exchange, and each role's Jupyter configuration (course_env's config.yml).
    assert oct((out / "exchange").stat().st_mode & 0o7777) == "0o1777"
    jupyter = out / "head" / "jupyter"
    students = json.loads((jupyter / "students" / "jupyter_server_config.json").read_text())
    extensions = students["ServerApp"]["jpserver_extensions"]
    assert extensions["nbgrader.server_extensions.formgrader"] is False
    assert extensions["nbgrader.server_extensions.assignment_list"] is True
    for role in ("students", "instructors"):
        nbgrader_config = (jupyter / role / "nbgrader_config.py").read_text()
        assert f'c.Exchange.root = "{out}/exchange"' in nbgrader_config
        compile(nbgrader_config, "nbgrader_config.py", "exec")

    second = _recap(_check(_run(cmd, ROOT, tmp_path)))
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in second.values()), second


def test_example_inventory_renders(tmp_path: Path) -> None:
    """The shipped example (4 nodes x 8 GPUs) renders sensibly: a dry run showing the diff of every
    file the head node would get, run on this machine instead of the placeholder host (the
    controller's slurm.conf and gres.conf already name every node)."""
    out = tmp_path / "out"
    cmd = [
        "ansible-playbook",
        "render.yml",
        "--check",
        "--diff",
        "--limit",
        "head01",
        "-e",
        "ansible_connection=local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        f"slurm_conf_dir={out}/slurm",
        "-e",
        f"jupyterhub_conf_dir={out}/jupyterhub",
    ]
    output = _check(_run(cmd, ANSIBLE_DIR, tmp_path))
    recap = _recap(output)
    assert set(recap) == {"head01"} and recap["head01"]["failed"] == 0, recap
    assert not out.exists(), "--check must not write anything"

    for i in range(1, 5):
        assert (
            f"NodeName=gpu0{i} NodeAddr=192.0.2.1{i} CPUs=128 RealMemory=1000000 Gres=gpu:8"
            in output
        )
        assert f"NodeName=gpu0{i} Name=gpu File=/dev/nvidia[0-7]" in output
    assert "SlurmctldHost=head01(192.0.2.10)" in output
    assert "PartitionName=gpu Nodes=ALL Default=YES MaxTime=8:00:00 State=UP" in output
    assert 'c.SlurmSpawner.req_gres = "gpu:1"' in output


@pytest.mark.parametrize(
    ("gpus_seen", "expected"),
    [
        (2, None),
        (1, "gpu01 has 1 GPU(s) but the inventory sets slurm_gpus=2"),
        (None, 'nvidia-smi failed on gpu01 (exit 9): "NVIDIA-SMI has failed'),
    ],
    ids=["all-present", "one-missing", "no-driver"],
)
def test_nvidia_smi_check(tmp_path: Path, gpus_seen: int | None, expected: str | None) -> None:
    """The nvidia_gpu role's check, against a stand-in nvidia-smi: it passes when the node has
    the GPUs the inventory promises Slurm, and otherwise fails saying what is wrong."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    if gpus_seen is None:  # what nvidia-smi prints when the driver is not loaded
        body = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver."\n'
        body += "exit 9\n"
    else:
        body = "".join(
            f'echo "{i}, NVIDIA H100 80GB HBM3, 00000000:{i + 0x18:02X}:00.0"\n'
            for i in range(gpus_seen)
        )
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\n" + body)
    (fake_bin / "nvidia-smi").chmod(0o755)
    playbook = tmp_path / "check.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Check GPUs",
                    "hosts": "gpu01",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Run the nvidia_gpu check",
                            "ansible.builtin.include_role": {
                                "name": str(ANSIBLE_DIR / "roles" / "nvidia_gpu"),
                                "tasks_from": "check",
                            },
                        }
                    ],
                }
            ]
        )
    )
    inventory = f"gpu01 ansible_connection=local ansible_python_interpreter={sys.executable}"
    (tmp_path / "hosts").write_text(inventory + " slurm_gpus=2\n")
    proc = _run(["ansible-playbook", "-i", "hosts", str(playbook)], tmp_path, tmp_path, (fake_bin,))
    output = proc.stdout + proc.stderr
    if expected is None:
        assert proc.returncode == 0, output
        assert f"{gpus_seen} GPU(s) found" in output
    else:
        assert proc.returncode != 0, output
        assert expected in " ".join(output.split()), output
