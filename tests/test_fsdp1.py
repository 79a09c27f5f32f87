"""FSDP1 and FSDP2 side by side on CPU (gloo), as torch 2.13 runs them: each ShardingStrategy
and its FSDP2 equivalent train to the same parameters, and the parameters held between
forward and backward match minidist.parallel.fsdp1's formula, for torch's FSDP1 and for minidist's
FSDP with reshard_after_forward."""

from __future__ import annotations

import warnings

import pytest
import torch

from minidist.communication import counting
from minidist.core.launch import run
from minidist.parallel import fsdp1
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT, TransformerBlock, lm_loss

STEPS = 2


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, hidden=32, heads=2, layers=2, max_seq=16)


def tokens(rank: int):
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    return ids[:, :-1], ids[:, 1:]


def train(model, rank, held=None):
    """STEPS AdamW steps through `model(ids)` (FSDP1 hooks the wrapper's forward);
    `held()`, if given, is read between the first forward and its backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = tokens(rank)
    measured = None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model(ids), targets)
        if step == 0 and held is not None:
            measured = held()
        loss.backward()
        optimizer.step()
    return measured


def fsdp1_held(model) -> int:
    """Bytes of FSDP1's flat parameters now: local shards and unsharded buffers (internals:
    torch has no public counter of them on CPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    storages = {}
    for module in FSDP.fsdp_modules(model):
        flat = module._handle.flat_param
        for tensor in (flat, flat._local_shard, getattr(flat, "_full_param_padded", None)):
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def side_by_side(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world_size,))
    found = {}
    for strategy, reshard in (("FULL_SHARD", True), ("SHARD_GRAD_OP", False)):
        model = gpt()
        wrapped = FSDP(model, sharding_strategy=ShardingStrategy[strategy],
                       auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                       device_id=torch.device("cpu"), use_orig_params=True)
        held = train(wrapped, rank, lambda wrapped=wrapped: fsdp1_held(wrapped))
        with FSDP.summon_full_params(wrapped):
            one = {k: v.clone() for k, v in model.state_dict().items()}
        two_model = gpt()
        for block in two_model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(two_model, mesh=mesh, reshard_after_forward=reshard)
        train(two_model, rank)
        two = {k: v.full_tensor() for k, v in two_model.state_dict().items()}
        ours = FullyShardedDataParallel(gpt(), units=lambda m: list(m.blocks),
                                        reshard_after_forward=reshard)
        with counting.count_traffic() as log:
            ours_held = train(ours, rank, ours.sharded_bytes)
        mine = ours.full_state_dict()
        blocks = [sum(p.numel() for p in block.parameters()) for block in gpt().blocks]
        root = sum(p.numel() for p in gpt().parameters()) - sum(blocks)
        found[strategy] = dict(
            fsdp2=max((one[k] - two[k]).abs().max().item() for k in one),
            minidist=max((one[k] - mine[k]).abs().max().item() for k in one),
            held=held, ours_held=ours_held,
            formula=fsdp1.parameter_bytes_after_forward(strategy, blocks, root, world_size),
            gathers=log.calls("all_gather") / STEPS, blocks=len(blocks))
    return found


def test_fsdp1_strategies_equal_their_fsdp2_pairs_and_hold_what_the_formula_says():
    for found in run(side_by_side, 2):
        for strategy, r in found.items():
            assert r["fsdp2"] <= 1e-6 and r["minidist"] <= 1e-6, (strategy, r)
            assert r["held"] == r["formula"] == r["ours_held"], (strategy, r)
            # FULL_SHARD gathers every block twice (forward, backward), SHARD_GRAD_OP once;
            # minidist's root unit here holds the embeddings, norm and head: once either way
            per_block = 2 if strategy == "FULL_SHARD" else 1
            assert r["gathers"] == per_block * r["blocks"] + 1, (strategy, r)
        assert found["SHARD_GRAD_OP"]["held"] > found["FULL_SHARD"]["held"]  # not an OOM fix


def test_strategy_names_and_formulas():
    class Member:  # what ShardingStrategy.SHARD_GRAD_OP looks like to the formula
        name = "SHARD_GRAD_OP"

    assert fsdp1.strategy_name(Member()) == "SHARD_GRAD_OP"
    assert fsdp1.parameter_bytes_after_forward("NO_SHARD", [10, 10], 4, 2) == 96
    assert fsdp1.parameter_bytes_after_forward("FULL_SHARD", [10, 10], 4, 2) == 4 * (12 + 4)
    assert fsdp1.parameter_bytes_after_forward("SHARD_GRAD_OP", [10, 10], 4, 2) == 4 * (12 + 24)
    assert fsdp1.parameter_bytes_after_forward("HYBRID_SHARD", [10, 10], 4, 4,
                                               shard_size=2) == 4 * (12 + 4)
    with pytest.raises(ValueError, match="sharding strategy 'FULL': choose one of FULL_SHARD"):
        fsdp1.parameter_bytes_after_forward("FULL", [10], 0, 2)
    with pytest.raises(ValueError, match="HYBRID_SHARD shards over the ranks of one node"):
        fsdp1.parameter_bytes_after_forward("HYBRID_SHARD", [10], 0, 4)
    with pytest.raises(ValueError, match="shard_size=3 does not divide world_size=4"):
        fsdp1.parameter_bytes_after_forward("HYBRID_SHARD", [10], 0, 4, shard_size=3)
