"""What one GPU shows of Lab 08: matmul FLOP/s, TinyGPT MFU, model-state memory per ZeRO stage.

    python bench/gpu_check.py [--peak-tflops 989]

1. Achieved bf16 matmul FLOP/s (`minidist.profiling.measure_peak_flops`, 8192 x 8192) against
   the GPU's datasheet peak (dense bf16, without sparsity; pass --peak-tflops for a GPU the table
   does not know).
2. TinyGPT's MFU in bf16 autocast: tokens/s x (6Ψ + 12·L·h·s) / peak (`minidist.flops.mfu`),
   against the datasheet and against the measured matmul peak.
3. Model-state memory of one rank of N = 8 under ZeRO stages 0-3, measured with
   `torch.cuda.memory_allocated` (held) and `max_memory_allocated` (peak) against
   `minidist.memory.model_state_bytes`: bf16
   parameters and gradients, and fp32 master weights with AdamW's m and v, each kept whole or
   as the 1/N shard the stage gives a rank, then one AdamW step on the fp32 master shard. One
   GPU holds one rank's share; no collective runs.

Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minidist import flops, memory
from minidist.models import TinyGPT
from minidist.profiling import measure_peak_flops

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
