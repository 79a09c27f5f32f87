"""Distributed gradient clipping (minidist.parallel.clipping) equals single-process
torch.nn.utils.clip_grad_norm_ on the whole model: FSDP and ZeRO on 2 and 4 ranks, a
tp2·pp2 model, and torch's own clip on FSDP2's DTensor parameters."""

from __future__ import annotations

import math

import pytest
import torch

from minidist.communication import collectives, counting
from minidist.communication.mesh import Mesh
from minidist.core.launch import RankError, RankTimeout, run
from minidist.parallel import clipping, pipeline_exec
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT, lm_loss
from minidist.parallel.parallelize import parallelize
from minidist.parallel.zero import ZeroOptimizer
from minidist.parallel.zero_offload import ZeroOffloadOptimizer

MAX_NORM = 0.05  # below the model's gradient norm (about 0.6): clipping scales


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, hidden=32, heads=4, layers=2, max_seq=16)


def batch():
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def single_process(norm_type=2.0):
    """Norm and clipped gradients of one process on the whole batch, by torch."""
    model = gpt()
    model.loss(*batch()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    return norm.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def my_slice(rank, world_size):
    ids, targets = batch()
    mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    return ids[mine], targets[mine]


def sharded_clips(rank, world_size, norm_type):
    expected_norm, expected = single_process(norm_type)
    ids, targets = my_slice(rank, world_size)
    found = {}
    model = FullyShardedDataParallel(gpt())
    model.loss(ids, targets).backward()
    with counting.count_traffic() as log:
        norm = clipping.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)
    full = model.full_state_dict()  # parameters; the clipped gradients are gathered below
    grads = {}
    for unit in model.units:
        for flat in unit.flats:
            whole = collectives.all_gather(flat.shard.grad, flat.numel)
            offset = 0
            for slot in flat.slots:
                for name in slot.names:
                    grads[name] = whole[offset:offset + slot.shape.numel()].view(slot.shape)
                offset += slot.shape.numel()
    found["fsdp"] = (norm.item(), grads, log.calls("all_reduce"))
    assert set(full) >= set(grads)
    for stage in (1, 2):
        for target in (None, "host"):
            model = gpt()
            if target is None:
                optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                          lr=1e-3)
            else:
                optimizer = ZeroOffloadOptimizer(model.parameters(), torch.optim.AdamW,
                                                 stage=stage, offload=target, lr=1e-3)
            model.loss(ids, targets).backward()
            optimizer.reduce_gradients()
            with counting.count_traffic() as log:
                norm = clipping.clip_grad_norm_(optimizer.shards, MAX_NORM, norm_type=norm_type)
            grads = {name: collectives.all_gather(shard.grad, p.numel()).view_as(p)
                     for (name, p), shard in zip(model.named_parameters(), optimizer.shards,
                                                 strict=True)}
            found[f"zero-{stage} offload={target}"] = (norm.item(), grads,
                                                       log.calls("all_reduce"))
    return expected_norm, expected, found


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_sharded_clipping_equals_single_process(world_size, norm_type):
    for expected_norm, expected, found in run(sharded_clips, world_size, norm_type):
        for name, (norm, grads, all_reduces) in found.items():
            assert abs(norm - expected_norm) <= 1e-6, (name, norm, expected_norm)
            error = max((grads[k] - expected[k]).abs().max().item() for k in expected)
            assert error <= 1e-6, (name, error)
            assert all_reduces == 1, (name, all_reduces)  # one all-reduce of the local sums


def tensor_and_pipeline(rank, world_size):
    expected_norm, expected = single_process()
    mesh = Mesh(pp=2, dp=1, tp=2)
    parallel = parallelize(gpt(), mesh, lambda params: torch.optim.SGD(params, lr=0.0),
                           microbatches=2)
    stage = parallel.stage
    ids, targets = batch()
    pipeline_exec.execute(parallel.schedule, {parallel.stage_index: parallel.module},
                          ids if stage.is_first else None, targets if stage.is_last else None,
                          lm_loss, group=mesh.group("pp"))
    before = {name: p.grad.clone() for name, p in stage.named_parameters()}
    replicated = clipping.replicated_parameters(stage)
    norms = {}
    for counted_once in (True, False):  # the right way, then the t-times mistake
        for p, grad in zip(stage.parameters(), before.values(), strict=True):
            p.grad = grad.clone()
        norms[counted_once] = clipping.clip_grad_norm_(
            stage.parameters(), MAX_NORM, group=(mesh.group("tp"), mesh.group("pp")),
            replicated=replicated if counted_once else (),
            replicated_group=mesh.group("tp") if counted_once else None).item()
    # the last clip counted them t times: redo the right one to compare the gradients
    for p, grad in zip(stage.parameters(), before.values(), strict=True):
        p.grad = grad.clone()
    clipping.clip_grad_norm_(stage.parameters(), MAX_NORM,
                             group=(mesh.group("tp"), mesh.group("pp")), replicated=replicated,
                             replicated_group=mesh.group("tp"))
    scales = {name: (p.grad / before[name]).nan_to_num(nan=0.0).abs().max().item()
              for name, p in stage.named_parameters()}
    names = dict(zip(map(id, stage.parameters()), dict(stage.named_parameters()), strict=True))
    whole = {}  # replicated parameters are whole: compare them with the single process's
    state_keys = stage.full_state_dict().keys()
    for p in replicated:
        local = names[id(p)]
        key = next(k for k in state_keys if _same_layer(k, local, stage.first_block))
        whole[key] = p.grad
    return expected_norm, norms, scales, {k: (v - expected[k]).abs().max().item()
                                          for k, v in whole.items()}


def _same_layer(key: str, local: str, first_block: int) -> bool:
    """Does TinyGPT's state_dict `key` name the stage parameter `local`?"""
    if local.startswith("blocks."):
        index, rest = local.split(".", 2)[1:]
        return key == f"blocks.{int(index) + first_block}.{rest}"
    if local.startswith("embeddings."):
        return key == local.removeprefix("embeddings.")
    return key == local


def test_tensor_and_pipeline_parallel_clipping_equals_single_process():
    for expected_norm, norms, scales, whole in run(tensor_and_pipeline, 4):
        assert abs(norms[True] - expected_norm) <= 1e-6, (norms, expected_norm)
        assert norms[False] > expected_norm * (1 + 1e-3)  # replicated counted twice: too big
        factor = MAX_NORM / (expected_norm + 1e-6)
        assert all(abs(scale - factor) <= 1e-5 for scale in scales.values()), scales
        assert whole and max(whole.values()) <= 1e-6, whole


def torch_on_dtensors(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    expected_norm, _ = single_process()
    model = gpt()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.loss(*my_slice(rank, world_size)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return expected_norm, norm.full_tensor().item()


def test_torch_clip_on_fsdp2_dtensors_gives_the_same_norm():
    for expected_norm, norm in run(torch_on_dtensors, 2):
        assert abs(norm - expected_norm) <= 1e-6


@pytest.mark.parametrize("max_norm", [0, -1.0, True, "1"])
def test_non_positive_max_norm_raises_before_any_collective(max_norm):
    def clip(rank, world_size):
        model = FullyShardedDataParallel(gpt())
        model.loss(*my_slice(rank, world_size)).backward()
        clipping.clip_grad_norm_(model.parameters(), max_norm)

    with pytest.raises(RankError, match=f"max_norm={max_norm!r}: must be a positive number") as e:
        run(clip, 2, timeout=20)
    assert not isinstance(e.value, RankTimeout)


def test_bad_norm_type_and_replicated_without_group():
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match="norm_type=1"):
        clipping.clip_grad_norm_([param], 1.0, norm_type=1)
    with pytest.raises(ValueError, match="replicated parameters need replicated_group"):
        clipping.clip_grad_norm_([param], 1.0, replicated=[param])


def test_without_a_process_group_it_is_torchs_clip():
    model, twin = gpt(), gpt()
    for m in (model, twin):
        m.loss(*batch()).backward()
    norm = clipping.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert abs(norm.item() - torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)) < 1e-6
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_fp64_gradients_keep_fp64_norms(norm_type):
    """Nothing below the input's precision: an fp64 model's norm is torch's fp64 norm to
    rounding, not an fp32 sum's (about 1e-7 off)."""
    model, twin = gpt().double(), gpt().double()
    for m in (model, twin):
        m.loss(*batch()).backward()
    norm = clipping.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM, norm_type=norm_type)
    assert norm.dtype == torch.float64, f"the norm of fp64 gradients came back {norm.dtype}"
    assert abs(norm.item() - expected.item()) <= 1e-12 * expected.item(), (norm, expected)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=0), "fp64 gradients clipped"
