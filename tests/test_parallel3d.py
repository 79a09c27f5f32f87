"""minidist.communication.mesh and minidist.parallel.parallelize on 8 ranks: the mesh's groups are
init_device_mesh's, TP x PP x DP/ZeRO trains exactly like one process and sends what
minidist.costs.traffic.mesh_traffic predicts per mesh dimension, and bad layouts are clear errors
before any rank communicates. One launch of 8 ranks checks every layout."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minidist.communication.mesh import Mesh, group_ranks
from minidist.core.launch import run
from minidist.costs.traffic import mesh_traffic
from minidist.parallel.models import TinyGPT
from minidist.parallel.parallelize import parallelize

DIMS = ("pp", "dp", "tp")  # Megatron's order, slowest first: Mesh(pp=, dp=, tp=)

# One worker runs every test here, so the 8-rank launch (the module fixture) runs once.
pytestmark = pytest.mark.xdist_group("parallel3d")

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32, 16, 4, 4, 8, 8
STEPS, LR = 3, 1e-2
# (dp, pp, tp, microbatches, zero_stage, sequence_parallel, schedule)
LAYOUTS = [(2, 2, 2, 2, 1, False, "1f1b"), (1, 2, 4, 4, 0, True, "1f1b"),
           (4, 1, 2, 2, 1, True, "1f1b"), (2, 4, 1, 2, 0, False, "gpipe")]


def _model(**overrides) -> TinyGPT:
    torch.manual_seed(0)
    config = dict(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS, max_seq=SEQ)
    return TinyGPT(**(config | overrides))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _adamw(params):
    # The attention's k_proj bias has a true gradient of exactly zero (softmax ignores a shift
    # shared by all keys): its gradient is float noise (~1e-10), which Adam with the default
    # eps=1e-8 turns into steps of ~lr, different for every summation order. eps=1e-5 keeps
    # that noise negligible; every other gradient (>= 1e-3) is still normalised as usual.
    return torch.optim.AdamW(params, lr=LR, eps=1e-5)


def _error(fn) -> str:
    with pytest.raises(ValueError) as error:
        fn()
    return str(error.value)


def _train_every_layout(rank: int, world_size: int) -> dict:
    ids, targets = _batch()
    results, meshes = {}, {}
    for dp, pp, tp, m, zero, sp, schedule in LAYOUTS:
        mesh = meshes[dp, pp, tp] = Mesh(pp=pp, dp=dp, tp=tp)
        theirs = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=DIMS)
        groups = {
            "ours": {d: mesh.ranks(d) for d in DIMS},
            "torch": {d: dist.get_process_group_ranks(theirs.get_group(d)) for d in DIMS},
            "to_torch": {d: dist.get_process_group_ranks(mesh.to_torch().get_group(d))
                         for d in DIMS},
            "names": mesh.to_torch().mesh_dim_names,
            "coords": {d: mesh.coord(d) for d in DIMS},
            "torch_coords": dict(zip(DIMS, theirs.get_coordinate(), strict=True)),
            "sizes": {d: mesh.size(d) for d in DIMS},
        }
        parallel = parallelize(_model(), mesh, _adamw, microbatches=m, schedule=schedule,
                               zero_stage=zero, sequence_parallel=sp)
        losses, traffic = [], None
        for _ in range(STEPS):
            losses.append(parallel.step(ids, targets))
            if traffic is None:
                expected = parallel.expected_traffic()
                traffic = {dim: (parallel.traffic[dim].bytes_sent, expected[dim].bytes_sent)
                           for dim in ("tp", "pp", "dp")}
        results[dp, pp, tp] = {"losses": losses, "state": parallel.full_state_dict(),
                               "traffic": traffic, "groups": groups}
    model = _model()
    results["errors"] = {
        "heads": _error(lambda: parallelize(_model(hidden=12, heads=6), meshes[1, 2, 4],
                                            _adamw, 2)),
        "ffn": _error(lambda: parallelize(_model(ffn_hidden=30), meshes[1, 2, 4], _adamw, 2)),
        "layers": _error(lambda: parallelize(_model(layers=2), meshes[2, 4, 1], _adamw, 2)),
        "batch": _error(lambda: parallelize(model, meshes[2, 2, 2], _adamw, 2).step(
            ids[:6], targets[:6])),
        "world": _error(lambda: Mesh(pp=2, dp=2, tp=4)),
    }
    return results


def _single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, (ids, targets) = _model(), _batch()
    optimizer = _adamw(model.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model.loss(ids, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run(_train_every_layout, 8, timeout=600)


def test_group_ranks_tp_fastest_then_dp_then_pp():
    sizes = {"pp": 2, "dp": 2, "tp": 2}
    expected = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for dim, groups in expected.items():
        got = group_ranks(sizes, dim)
        assert got == groups, f"{dim} groups: expected {groups}, got {got}"
    with pytest.raises(ValueError, match="dim='ep'"):
        group_ranks(sizes, "ep")


def test_mesh_groups_equal_init_device_mesh_for_every_layout(per_rank):
    for dp, pp, tp, *_ in LAYOUTS:
        for rank, result in enumerate(per_rank):
            found = result[dp, pp, tp]["groups"]
            label = f"rank {rank}, dp={dp} pp={pp} tp={tp}"
            assert found["ours"] == found["torch"] == found["to_torch"], (
                f"{label}: expected init_device_mesh's groups {found['torch']}, got "
                f"{found['ours']} (to_torch: {found['to_torch']})")
            assert found["names"] == DIMS, f"expected dim names {DIMS}, got {found['names']}"
            assert found["coords"] == found["torch_coords"], (
                f"{label}: expected coordinates {found['torch_coords']}, got {found['coords']}")
            assert found["sizes"] == {"pp": pp, "dp": dp, "tp": tp}, (
                f"{label}: expected those sizes, got {found['sizes']}")


def test_every_layout_trains_like_one_process(per_rank):
    losses, state = _single_process()
    for dp, pp, tp, m, zero, sp, schedule in LAYOUTS:
        label = f"dp={dp} pp={pp} tp={tp} m={m} zero={zero} sp={sp} {schedule}"
        for rank, result in enumerate(per_rank):
            got = result[dp, pp, tp]
            for step, (want, have) in enumerate(zip(losses, got["losses"], strict=True)):
                assert abs(have - want) <= 1e-5 * abs(want), (
                    f"{label}, rank {rank}, step {step}: expected loss {want:.7f}, got {have:.7f}")
            assert got["state"].keys() == state.keys(), (
                f"{label}: expected keys {sorted(state)}, got {sorted(got['state'])}")
            error = max((got["state"][k] - v).abs().max().item() for k, v in state.items())
            assert error <= 1e-5, f"{label}, rank {rank}: parameters differ by {error:.2e}"


def test_bytes_per_mesh_dimension_equal_the_formulas(per_rank):
    for dp, pp, tp, *_ in LAYOUTS:
        for rank, result in enumerate(per_rank):
            for dim, (counted, formula) in result[dp, pp, tp]["traffic"].items():
                assert abs(counted - formula) <= 0.01 * formula, (
                    f"dp={dp} pp={pp} tp={tp}, rank {rank}, {dim}: expected {formula:.0f} "
                    f"bytes sent (minidist.costs.traffic.mesh_traffic), counted {counted:.0f}")
                size = {"dp": dp, "pp": pp, "tp": tp}[dim]
                assert (counted > 0) == (size > 1), (
                    f"dp={dp} pp={pp} tp={tp}, rank {rank}: {dim} of size {size} sent "
                    f"{counted:.0f} bytes")


def test_mesh_traffic_adds_up_lab_02s_formulas():
    """First of 2 stages, tp=2, dp=2, ZeRO-1, 2 blocks, 2 microbatches of 1·8·16 fp32."""
    got = mesh_traffic(stage=0, pp=2, dp=2, tp=2, blocks=2, num_params=1000, param_tensors=10,
                       seq_len=8, micro_batch=1, hidden=16, microbatches=2)
    activation = 1 * 8 * 16 * 4
    expected = {
        "tp": 2 * 2 * 4 * activation,  # 4 all-reduces per block and microbatch, 2(t-1)/t = 1
        "pp": 2 * activation,  # the first stage sends activations only
        "dp": 1000 * 4 + 10 * 4,  # reduce-scatter + all-gather, (N-1)/N = 1/2 each; flags
    }
    for dim, want in expected.items():
        assert got[dim].bytes_sent == want, (
            f"{dim}: expected {want} bytes sent, got {got[dim].bytes_sent}")
    with pytest.raises(ValueError, match="stage=2"):
        mesh_traffic(stage=2, pp=2, dp=1, tp=1, blocks=1, num_params=1, param_tensors=1,
                     seq_len=1, micro_batch=1, hidden=1, microbatches=1)


def test_bad_layouts_are_clear_errors(per_rank):
    errors = per_rank[0]["errors"]
    expected = {"heads": ["heads=6", "tp=4"], "ffn": ["ffn_hidden=30", "tp=4"],
                "layers": ["layers=2", "pp=4"], "batch": ["batch 6", "2·2 = 4"],
                "world": ["16", "8 ranks"]}
    for case, words in expected.items():
        assert all(word in errors[case] for word in words), (
            f"{case}: expected an error naming {words}, got {errors[case]!r}")
