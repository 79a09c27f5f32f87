"""minidist.mesh: Megatron's rank order, the same groups as PyTorch's init_device_mesh."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minidist.launch import run
from minidist.mesh import DIMS, Mesh, group_ranks

LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)]  # (dp, pp, tp)


def test_group_ranks_tp_fastest_then_dp_then_pp():
    sizes = {"pp": 2, "dp": 2, "tp": 2}
    expected = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for dim, groups in expected.items():
        got = group_ranks(sizes, dim)
        assert got == groups, f"{dim} groups: expected {groups}, got {got}"
    with pytest.raises(ValueError, match="dim='ep'"):
        group_ranks(sizes, "ep")


def _groups_of_every_layout(rank: int, world_size: int) -> list[dict]:
    found = []
    for dp, pp, tp in LAYOUTS:
        mesh = Mesh(dp=dp, pp=pp, tp=tp)
        theirs = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=DIMS)
        ours_as_torch = mesh.to_torch()
        found.append({
            "layout": (dp, pp, tp),
            "ours": {d: mesh.ranks(d) for d in DIMS},
            "torch": {d: dist.get_process_group_ranks(theirs.get_group(d)) for d in DIMS},
            "to_torch": {d: dist.get_process_group_ranks(ours_as_torch.get_group(d))
                         for d in DIMS},
            "names": ours_as_torch.mesh_dim_names,
            "coords": {d: mesh.coord(d) for d in DIMS},
            "torch_coords": dict(zip(DIMS, theirs.get_coordinate(), strict=True)),
            "sizes": {d: mesh.size(d) for d in DIMS},
            "group_works": _sum_over(mesh, "tp"),
        })
    return found


def _sum_over(mesh: Mesh, dim: str) -> int:
    import torch

    x = torch.tensor([mesh.rank])
    dist.all_reduce(x, group=mesh.group(dim))
    return int(x)


def test_mesh_groups_equal_init_device_mesh_for_every_layout():
    per_rank = run(_groups_of_every_layout, 8, timeout=120)
    for rank, layouts in enumerate(per_rank):
        for found in layouts:
            dp, pp, tp = found["layout"]
            assert found["ours"] == found["torch"] == found["to_torch"], (
                f"rank {rank}, dp={dp} pp={pp} tp={tp}: expected init_device_mesh's groups "
                f"{found['torch']}, got {found['ours']} (to_torch: {found['to_torch']})")
            assert found["names"] == DIMS, f"expected dim names {DIMS}, got {found['names']}"
            assert found["coords"] == found["torch_coords"], (
                f"rank {rank}: expected coordinates {found['torch_coords']}, "
                f"got {found['coords']}")
            assert found["sizes"] == {"pp": pp, "dp": dp, "tp": tp}, (
                f"expected sizes pp={pp} dp={dp} tp={tp}, got {found['sizes']}")
            expected_sum = sum(found["ours"]["tp"])
            assert found["group_works"] == expected_sum, (
                f"rank {rank}: an all-reduce over its tp group {found['ours']['tp']} should "
                f"give {expected_sum}, got {found['group_works']}")


def _wrong_world_size(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as error:
        Mesh(dp=2, pp=2, tp=2)
    return str(error.value)


def test_wrong_world_size_is_a_clear_error_before_any_collective():
    messages = run(_wrong_world_size, 2)
    assert "8" in messages[0] and "2 ranks" in messages[0], (
        f"expected a message naming dp·pp·tp = 8 and the 2 ranks, got {messages[0]!r}")
