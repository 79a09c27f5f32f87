"""What one GPU shows of Labs 08 and 12: matmul FLOP/s, TinyGPT MFU, model-state memory per ZeRO
stage, and what offloading the optimizer state to the host frees.

    python bench/gpu_check.py [--peak-tflops 989]

1. Achieved bf16 matmul FLOP/s (`minidist.jobs.profiling.measure_peak_flops`, 8192 x 8192) against
   the GPU's datasheet peak (dense bf16, without sparsity; pass --peak-tflops for a GPU the table
   does not know).
2. TinyGPT's MFU in bf16 autocast: tokens/s x (6Ψ + 12·L·h·s) / peak (`minidist.costs.flops.mfu`),
   against the datasheet and against the measured matmul peak.
3. Model-state memory of one rank of N = 8 under ZeRO stages 0-3, measured with
   `torch.cuda.memory_allocated` (held) and `max_memory_allocated` (peak) against
   `minidist.costs.memory.model_state_bytes`: bf16
   parameters and gradients, and fp32 master weights with AdamW's m and v, each kept whole or
   as the 1/N shard the stage gives a rank, then one AdamW step on the fp32 master shard. One
   GPU holds one rank's share; no collective runs.
4. Lab 12, ZeRO-Offload on one GPU (a one-rank NCCL group): TinyGPT in bf16 trained one step
   by `minidist.parallel.zero_offload.ZeroOffloadOptimizer(stage=2)` with the optimizer state on
   the GPU (`offload=None`) and with `offload="host"`; `torch.cuda.memory_allocated` after the
   step (gradients freed) drops by the fp32 master weights and AdamW's m and v, 12Ψ bytes
   (`minidist.costs.tiers`), and the bytes moved per step equal `tiers.offload_transfer_bytes`.
5. Lab 12, minidist's `FullyShardedDataParallel(offload="host")` against PyTorch's FSDP2
   `fully_shard(..., offload_policy=CPUOffloadPolicy())` (which needs a GPU): 3 AdamW steps
   from the same weights, the largest parameter difference; and the GPU memory each holds
   after the step against the same model without offload.

Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from minidist.costs import flops, memory, tiers
from minidist.jobs.profiling import measure_peak_flops
from minidist.parallel import offload
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT
from minidist.parallel.zero_offload import ZeroOffloadOptimizer

# Dense bf16 tensor-core peak FLOP/s from NVIDIA's datasheets (the sparsity figures are twice
# these). Matched against torch.cuda.get_device_name(), most specific first.
DATASHEET_BF16 = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM5
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
}
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32768, 1024, 16, 12, 1024, 8
ZERO_RANKS = 8
MiB = 2**20


def datasheet_peak(name: str) -> float | None:
    """The dense bf16 peak of the GPU named `name`, or None when the table lacks it."""
    return next((peak for key, peak in DATASHEET_BF16.items() if key in name), None)


def tinygpt_tokens_per_second(device: torch.device, steps: int = 10) -> tuple[float, TinyGPT]:
    """Tokens/s of forward, backward and AdamW steps in bf16 autocast, after 3 warm-up steps."""
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    return steps * BATCH * SEQ / (time.perf_counter() - start), model


def zero_stage_bytes(num_params: int, stage: int, ranks: int,
                     device: torch.device) -> tuple[int, int]:
    """Bytes one rank's model state holds under ZeRO `stage` of `ranks` after one AdamW step of
    its fp32 master shard (m and v are created by that step), and the peak during it
    (`torch.cuda.max_memory_allocated`: also the fp32 gradient slice and AdamW's temporaries)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    shard = -(-num_params // ranks)  # ceil: real implementations pad to a multiple of N
    params = torch.zeros(shard if stage >= 3 else num_params, dtype=torch.bfloat16, device=device)
    grads = torch.zeros(shard if stage >= 2 else num_params, dtype=torch.bfloat16, device=device)
    master = torch.zeros(shard if stage >= 1 else num_params, dtype=torch.float32, device=device,
                         requires_grad=True)
    master.grad = torch.zeros_like(master)  # the fp32 gradient slice the update reads, then freed
    optimizer = torch.optim.AdamW([master], lr=1e-4, foreach=False)
    optimizer.step()
    master.grad = None
    held = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    del params, grads, master, optimizer
    return held, peak


def one_rank_group() -> None:
    """A process group of this process alone (NCCL), for minidist's ZeRO and FSDP."""
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)


def offloaded_zero_bytes(device: torch.device) -> dict:
    """GPU bytes held after one ZeroOffloadOptimizer(stage=2) step and zero_grad, with the AdamW
    state on the GPU and on the host; and the bytes the offloaded step moved."""
    found = {}
    for target in (None, "host"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.manual_seed(0)
        model = TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).to(device, torch.bfloat16)
        optimizer = ZeroOffloadOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                                         offload=target, lr=1e-4)
        ids = torch.randint(0, VOCAB, (2, SEQ), device=device)
        with offload.transfers() as moved:
            model.loss(ids, ids).backward()
            optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize(device)
        found[target] = torch.cuda.memory_allocated(device) - base
        found["psi"] = sum(p.numel() for p in model.parameters())
        if target:
            found["moved"] = moved.totals
        del model, optimizer
    return found


def fsdp_against_cpu_offload_policy(device: torch.device, steps: int = 3) -> dict:
    """Largest parameter difference after `steps` AdamW steps between minidist's FSDP with
    offload="host" and FSDP2 with CPUOffloadPolicy, and the GPU bytes each (and minidist's
    FSDP without offload) holds after its last step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    def small() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(4096, 512, 8, 4, 256).to(device)

    ids = torch.randint(0, 4096, (4, 257), device=device, generator=None)
    trained, held = {}, {}
    for name in ("minidist, on the GPU", "minidist, offload='host'", "FSDP2 CPUOffloadPolicy"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        if name.startswith("FSDP2"):
            model = small()
            mesh = init_device_mesh("cuda", (1,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        else:
            model = FullyShardedDataParallel(
                small(), offload="host" if "offload" in name else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):
            optimizer.zero_grad()
            model.loss(ids[:, :-1], ids[:, 1:]).backward()
            optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize(device)
        held[name] = torch.cuda.memory_allocated(device) - base
        trained[name] = ({k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
                         if name.startswith("FSDP2")
                         else {k: v.cpu() for k, v in model.full_state_dict().items()})
        del model, optimizer
    ours, theirs = trained["minidist, offload='host'"], trained["FSDP2 CPUOffloadPolicy"]
    return {"difference": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
            "held": held}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-tflops", type=float,
                        help="the GPU's dense bf16 peak in TFLOP/s, if the built-in table lacks it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no GPU on this machine (torch.cuda.is_available() is False); nothing "
              "to measure. Run it on a machine with an NVIDIA GPU and a CUDA build of torch.")
        return 0
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    datasheet = args.peak_tflops * 1e12 if args.peak_tflops else datasheet_peak(name)
    print(f"GPU: {name}, torch {torch.__version__}")

    achieved = measure_peak_flops(torch.bfloat16, device)
    shown = f"{datasheet / 1e12:.0f} TFLOP/s" if datasheet else "unknown (pass --peak-tflops)"
    print(f"\n1. bf16 matmul 8192^3: {achieved / 1e12:.0f} TFLOP/s achieved; datasheet {shown}"
          + (f": {achieved / datasheet:.0%} of it" if datasheet else ""))

    tokens_per_second, model = tinygpt_tokens_per_second(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"\n2. TinyGPT (Ψ = {num_params / 1e6:.0f} M, L={LAYERS}, h={HIDDEN}, s={SEQ}, "
          f"b={BATCH}), bf16 autocast, AdamW: {tokens_per_second:,.0f} tokens/s")
    for label, peak in (("datasheet", datasheet), ("measured matmul peak", achieved)):
        if peak:
            utilization = flops.mfu(tokens_per_second, num_params, LAYERS, HIDDEN, SEQ, peak)
            print(f"   MFU against the {label}: {utilization:.1%}")
    del model
    torch.cuda.empty_cache()

    print(f"\n3. model state of one rank of N = {ZERO_RANKS}, Ψ = {num_params / 1e6:.0f} M, "
          f"bf16 mixed-precision AdamW")
    print("   stage   model_state_bytes MiB   held MiB   held/predicted   peak MiB")
    for stage in range(4):
        held, peak = zero_stage_bytes(num_params, stage, ZERO_RANKS, device)
        predicted = memory.model_state_bytes(num_params, stage, ZERO_RANKS).total
        print(f"   {stage:5d} {predicted / MiB:23.1f} {held / MiB:10.1f} "
              f"{held / predicted:16.3f} {peak / MiB:10.1f}")

    one_rank_group()
    found = offloaded_zero_bytes(device)
    psi = found["psi"]
    drop = found[None] - found["host"]
    state = tiers.model_state_by_tier(psi, 2, 1)
    formula = state.device - tiers.model_state_by_tier(psi, 2, 1, "host").device
    formula -= memory.bytes_per_param().grads * psi  # gradients are freed in both runs
    print(f"\n4. ZeRO-2 + offload on one GPU, TinyGPT Ψ = {psi / 1e6:.0f} M, bf16, AdamW: "
          f"memory_allocated after the step {found[None] / MiB:.1f} MiB on the GPU, "
          f"{found['host'] / MiB:.1f} MiB offloaded")
    print(f"   drop {drop / MiB:.1f} MiB; formula (fp32 master + m + v = 12Ψ) "
          f"{formula / MiB:.1f} MiB: ratio {drop / formula:.3f}")
    expected = tiers.offload_transfer_bytes(psi, 1)
    print(f"   moved per step: {found['moved']}; formula {expected}")

    compared = fsdp_against_cpu_offload_policy(device)
    print("\n5. FSDP offload against FSDP2 CPUOffloadPolicy, 3 AdamW steps: largest parameter "
          f"difference {compared['difference']:.2e}")
    for name, held in compared["held"].items():
        print(f"   {name:28s} memory_allocated after the step {held / MiB:8.1f} MiB")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
