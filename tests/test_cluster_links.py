"""Two tiers on the local Slurm cluster (root only): the links between its nodes shaped with
`cluster.sh shape` (tc), Lab 11's comparison run on them, and the pairwise check that finds a
degraded link. Both blocks of cluster_setup/README.md section 4 run word for word.

What is asserted is an ordering (hierarchical all-reduce sends two thirds of the flat ring's
bytes over each node's link here, on links shaped 20x or more below the loopback's speed) and
which pairs a check names, never a speed.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from cluster_fixtures import CLUSTER_SH, NODES, REPO

pytestmark = [pytest.mark.xdist_group("cluster")]

README = REPO / "cluster_setup" / "README.md"


def readme_block(needle: str) -> str:
    """The ```bash block of cluster_setup/README.md that contains `needle`."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    found = [block for block in blocks if needle in block]
    assert len(found) == 1, f"cluster_setup/README.md should have one block with {needle!r}"
    return found[0]


def run_block(local_cluster, block: str, timeout: float = 300) -> str:
    result = subprocess.run(["bash", "-e", "-c", block], cwd=REPO, env=local_cluster.env,
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    print(output)  # the measured numbers, in the test's report
    assert result.returncode == 0, output
    return output


def shaping(node: str) -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", f"slv-{node}"], capture_output=True,
                          text=True, check=True).stdout


def test_pairwise_check_finds_the_degraded_link(local_cluster):
    try:
        output = run_block(local_cluster, readme_block("PAIRWISE=1"))
    finally:
        subprocess.run([str(CLUSTER_SH), "shape", "off"], env=local_cluster.env, timeout=60)
    assert "links between nodes: gpu01 400mbit, gpu02 200mbit (each way)" in output, output
    slow = re.findall(r"^pair rank (\d) \((\w+)\) - rank (\d) \((\w+)\): .* SLOW$", output, re.M)
    # exactly the pairs with one rank on each node (block placement: ranks 0, 1 on gpu01)
    pairs = sorted((int(a), int(b)) for a, _, b, _ in slow)
    assert pairs == [(0, 2), (0, 3), (1, 2), (1, 3)], output
    assert all(x != y for _, x, _, y in slow)
    assert "node(s) in every slow pair: gpu01, gpu02" in output, output
    assert re.search(r"link check: slowest pair \S+ GB/s vs minimum 0.03 GB/s: FAIL", output)
    assert all("tbf" not in shaping(node) for node in NODES), "shape off left a tbf behind"


def test_hierarchical_all_reduce_beats_the_flat_ring_on_shaped_links(local_cluster):
    try:
        output = run_block(local_cluster, readme_block("hierarchy_check.py"))
    finally:
        subprocess.run([str(CLUSTER_SH), "shape", "off"], env=local_cluster.env, timeout=60)
    tiers = re.search(r"tiers: inside a node (\S+) MB/s, between nodes (\S+) MB/s", output)
    assert tiers, output
    inside, between = float(tiers[1]), float(tiers[2])
    assert between < inside, f"the shaping should make the inter-node tier the slow one: {output}"
    times = dict(re.findall(r"(ring|hierarchical|torch) ([\d.]+) ms", output))
    assert times.keys() == {"ring", "hierarchical", "torch"}, output
    ordering = re.search(r"ordering measured: (.*); model: (.*)", output)
    assert ordering, output
    measured, model = ordering[1].split(" < "), ordering[2].split(" < ")
    assert model == ["hierarchical", "ring"], output
    assert measured[0] == "hierarchical", f"hierarchical should come first, as modelled: {output}"


@pytest.mark.parametrize(("args", "message"), [
    ((), "usage: cluster.sh shape RATE [NODE=RATE ...]"),
    (("400mbit", "gpu09=100mbit"), "'gpu09=100mbit' should be NODE=RATE for a node of this "
                                   "cluster (gpu01 gpu02)"),
    (("400mbit", "gpu02"), "'gpu02' should be NODE=RATE"),
    (("fast",), "tc refused rate 'fast' for gpu01; give a tc rate such as 400mbit"),
])
def test_shape_refuses_bad_arguments(local_cluster, args, message):
    result = subprocess.run([str(CLUSTER_SH), "shape", *args], env=local_cluster.env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stdout + result.stderr
    assert all("tbf" not in shaping(node) for node in NODES)
