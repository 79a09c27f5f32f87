"""Every public API of minidist that communicates, counted by counting.count_traffic and checked
against its formula: construction (model checks, broadcasts) and steps alike.

Every collective goes through minidist.communication.collectives, so every one leaves a record; the
point-to-point APIs (pipelines, parameter servers) are checked on their sends. One launch of
2 ranks runs them all; 3D parallelism (parallelize) is checked per mesh dimension in
tests/test_parallel3d.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minidist.communication.counting import count_traffic
from minidist.communication.mesh import Mesh
from minidist.core.launch import run
from minidist.costs.traffic import (
    Collective,
    data_parallel_traffic,
    parameter_server_traffic,
    pipeline_traffic,
    tensor_parallel_traffic,
)
from minidist.parallel import pipeline, pipeline_exec, tensor_parallel
from minidist.parallel.compression import PowerSGD, TopK
from minidist.parallel.ddp import DistributedDataParallel
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import MLP, TinyGPT
from minidist.parallel.moe import MoELayer
from minidist.parallel.param_server import ParameterServer
from minidist.parallel.zero import ZeroOptimizer

LIB = Path(__file__).resolve().parents[1] / "lib" / "minidist"
N = 2
B, S, H, HEADS, FFN = 2, 4, 8, 2, 16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(8, 16, 4)


def _records(log) -> list[tuple[str, int, str]]:
    return [(c.op, c.nbytes, c.when) for c in log.collectives]


def _step(model: nn.Module, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(model(x), torch.zeros(4, 4)).backward()


def _ddp(rank: int) -> dict:
    psi = sum(p.numel() for p in _mlp().parameters())
    with count_traffic() as built:
        model = DistributedDataParallel(_mlp(), bucket_cap_mb=25)
    with count_traffic() as stepped:
        _step(model, rank)
    return {"built": _records(built), "stepped": stepped.traffic.volume, "psi": psi}


def _zero(rank: int, stage: int) -> dict:
    model = _mlp()
    optimizer = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    with count_traffic() as log:
        _step(model, rank)
        optimizer.step()
    return {"ops": [c.op for c in log.collectives], "traffic": log.traffic}


def _fsdp(rank: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, hidden=H, heads=HEADS, layers=2, max_seq=S)
    psi = sum(p.numel() for p in model.parameters())
    with count_traffic() as built:
        wrapped = FullyShardedDataParallel(model)
    ids = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(rank))
    with count_traffic() as stepped:
        wrapped.loss(ids, ids).backward()
    return {"built": _records(built), "psi": psi,
            "gathered": stepped.nbytes("all_gather"), "scattered": stepped.nbytes("reduce_scatter")}


def _tensor_parallel(rank: int) -> dict:
    torch.manual_seed(0)
    block = tensor_parallel.ParallelTransformerBlock(H, HEADS, FFN)
    x = torch.randn(B, S, H, requires_grad=True)
    with count_traffic() as log:
        block(x).sum().backward()
    return {"traffic": log.traffic}


def _moe(rank: int) -> dict:
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, experts=4, top_k=1)
    x = torch.randn(B * S, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with count_traffic() as log:
        layer(x).sum().backward()
    return {"calls": {when: log.calls("all_to_all", when)
                      for when in ("counts", "forward", "backward")},
            "ranks": {c.ranks for c in log.collectives}}


def _pipeline(rank: int) -> dict:
    s = pipeline.schedule("1f1b", N, 2)
    torch.manual_seed(0)
    stages = pipeline_exec.split_layers([nn.Linear(H, H) for _ in range(2)], N)
    x, y = torch.randn(4, H), torch.randn(4, H)
    with count_traffic() as log:
        pipeline_exec.execute(s, {rank: stages[rank]}, x, y, F.mse_loss)
    return {"sends": log.sends, "collectives": _records(log)}


def _parameter_server(rank: int) -> dict:
    mesh = Mesh(dp=2 * N)  # all ranks: workers 0..N-1, server N (rank N+1 sits out)
    if mesh.rank > N:
        return {}
    model = _mlp()
    ps = ParameterServer(model, list(range(N)), [N], lambda p: torch.optim.SGD(p, lr=0.1))
    with count_traffic() as log:
        if ps.is_server:
            ps.serve(1)
        else:
            _step(model, rank)
            ps.push_pull()
    return {"sent": log.bytes_sent, "collectives": _records(log)}


def _compression(rank: int) -> dict:
    found = {}
    for name, compression in (("topk", TopK(0.25)), ("powersgd", PowerSGD(1))):
        model = DistributedDataParallel(_mlp(), compression=compression)
        with count_traffic() as log:
            _step(model, rank)
        found[name] = log.per_collective()
    return found


def _everything(rank: int, world_size: int) -> dict:
    return {"ddp": _ddp(rank), "zero1": _zero(rank, 1), "zero2": _zero(rank, 2),
            "fsdp": _fsdp(rank), "tp": _tensor_parallel(rank), "moe": _moe(rank),
            "compression": _compression(rank), "pipeline": _pipeline(rank)}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run(_everything, N, timeout=120)


def test_ddp_records_its_model_check_broadcast_and_2_psi(per_rank):
    for result in per_rank:
        psi = result["ddp"]["psi"]
        assert result["ddp"]["built"] == [
            ("all_gather_object", result["ddp"]["built"][0][1], "model check"),
            ("broadcast", psi * 4, "parameters and buffers")], result["ddp"]["built"]
        expected = data_parallel_traffic(psi, N, 0, bytes_per_element=4).volume
        assert result["ddp"]["stepped"] == expected, (result["ddp"]["stepped"], expected)


def test_zero_records_equal_zero_sections_formulas(per_rank):
    for result in per_rank:
        for stage in (1, 2):
            traffic = result[f"zero{stage}"]["traffic"]
            psi = sum(p.numel() for p in _mlp().parameters())
            formula = data_parallel_traffic(psi, N, stage, bytes_per_element=4)
            tensors = len(list(_mlp().parameters()))
            flags = 2 * 4 * tensors if stage == 1 else 0  # ZeRO-1's which-have-a-gradient sum
            assert traffic.volume == formula.volume + flags, (stage, traffic.collectives)


def test_fsdp_records_its_broadcast_and_3_psi(per_rank):
    for result in per_rank:
        psi = result["fsdp"]["psi"]
        assert [op for op, _, _ in result["fsdp"]["built"]] == ["all_gather_object", "broadcast"]
        assert result["fsdp"]["built"][1][1] == psi * 4  # fp32 parameters, one flat broadcast
        assert (result["fsdp"]["gathered"], result["fsdp"]["scattered"]) == (
            2 * psi * 4, psi * 4), "FSDP: all-gather forward and backward, reduce-scatter: 3Ψ"


def test_tensor_parallel_block_records_megatrons_2_plus_2(per_rank):
    formula = tensor_parallel_traffic(S, B, H, N, bytes_per_element=4)
    for result in per_rank:
        assert result["tp"]["traffic"].volume == formula.volume
        assert sorted(c.when for c in result["tp"]["traffic"].collectives) == [
            "backward", "backward", "forward", "forward"]


def test_moe_records_two_all_to_alls_each_way_and_the_counts(per_rank):
    for result in per_rank:
        assert result["moe"]["calls"] == {"counts": 1, "forward": 2, "backward": 2}
        assert result["moe"]["ranks"] == {tuple(range(N))}


def test_compression_records_what_it_sends(per_rank):
    for result in per_rank:
        assert {op for op, _ in result["compression"]["topk"]} == {"all_gather"}
        assert {op for op, _ in result["compression"]["powersgd"]} == {"all_reduce"}


def test_pipeline_sends_are_the_formulas_and_no_collective(per_rank):
    formula = pipeline_traffic(1, 2, H, microbatches=2, bytes_per_element=4)  # [2, H] each
    for rank, result in enumerate(per_rank):
        sends = result["pipeline"]["sends"]
        kinds = [c for c in formula.collectives
                 if (c.when.startswith("activations") and rank == 0)
                 or (c.when.startswith("gradients") and rank == N - 1)]
        assert sum(nbytes for _, nbytes in sends) == sum(c.bytes_sent for c in kinds)
        assert {peer for peer, _ in sends} == {1 - rank}
        assert result["pipeline"]["collectives"] == []  # its barrier is set-up, uncounted


def test_parameter_server_sends_the_formulas():
    psi = sum(p.numel() for p in _mlp().parameters())
    formula = parameter_server_traffic(psi * 4, workers=N)
    results = run(lambda rank, world_size: _parameter_server(rank), 2 * N, timeout=120)
    for rank in range(N):
        assert results[rank]["sent"] == formula["worker"].bytes_sent
    assert results[N]["sent"] == formula["server"].bytes_sent
    assert all(not r.get("collectives") for r in results)


# --- The layering rules, read from the source --------------------------------------------------

COLLECTIVE_CALLS = {
    "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object_list", "gather", "scatter", "reduce", "gather_object", "scatter_object_list",
}


def _calls(path: Path) -> list[tuple[str, str, int]]:
    """(object, attribute, line) of every `object.attribute(...)` call in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name):
            found.append((node.func.value.id, node.func.attr, node.lineno))
    return found


def test_only_the_collective_layer_and_the_launcher_call_torch_collectives():
    allowed = {"collectives.py", "launch.py", "_supervisor.py"}
    offenders = [f"{path.name}:{line} dist.{attr}" for path in LIB.rglob("*.py")
                 if path.name not in allowed for name, attr, line in _calls(path)
                 if name == "dist" and attr in COLLECTIVE_CALLS]
    assert not offenders, f"call minidist.communication.collectives instead: {offenders}"


def test_only_the_collective_layer_records_and_only_the_mesh_makes_groups():
    records = [f"{p.name}:{line}" for p in LIB.rglob("*.py") if p.name != "collectives.py"
               for name, attr, line in _calls(p) if (name, attr) == ("counting", "record")]
    records += [f"{p.name}:{node.lineno}" for p in LIB.rglob("*.py") if p.name != "collectives.py"
                for node in ast.walk(ast.parse(p.read_text()))
                if isinstance(node, ast.ImportFrom)
                and node.module == "minidist.communication.counting"
                and "record" in {alias.name for alias in node.names}]
    assert not records, f"only minidist.communication.collectives records collectives: {records}"
    groups = [f"{p.name}:{line}" for p in LIB.rglob("*.py") if p.name != "mesh.py"
              for name, attr, line in _calls(p) if name == "dist" and attr == "new_group"]
    assert not groups, f"only minidist.communication.mesh creates process groups: {groups}"


def test_one_record_per_collective_with_its_group():
    """A record in a log names the ranks that took part (the group's global ranks)."""
    record = Collective("all_reduce", 4, 2, ranks=(1, 3))
    assert record == Collective("all_reduce", 4, 2)  # predictions and counts compare equal
    assert record.ranks == (1, 3)
