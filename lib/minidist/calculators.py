"""Live calculators for lab 02: memory per rank, and a pipeline-bubble explorer.

    display(MemoryCalculator().widget)     # sliders -> stacked bars against the GPU's memory
    display(BubbleExplorer().widget)       # schedule, p, m, v -> timeline and bubble

Each calculator is a function from values to data (`rank_memory`, `pipeline_timeline`), a
function from data to a figure (`draw_memory`, `draw_timeline`), and a thin widget that calls
them when a control moves. Tests set `calculator.controls[name].value` and read
`calculator.data`, `calculator.figure` and `calculator.message`; no browser is needed.

The pipeline timeline is a small simulator of its own (the full schedule library is
minidist.pipeline): every stage runs its operations in the schedule's order, each as soon as
the stage is free and its inputs have arrived; communication is free. Costs follow ZB §2:
T_F = T_B = T_W = 1 per microbatch per stage (divided by v for a chunk), and schedules that do
not split the backward run B and W as one pass of 2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from minidist import memory
from minidist.planner import MODELS, Layout, MemoryEstimate, Model, stage_memory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# --- Memory per rank --------------------------------------------------------------------------


def rank_memory(model: Model, dp: int = 8, tp: int = 1, pp: int = 1, seq_len: int | None = None,
                micro_batch: int = 1, recompute: str | None = None) -> dict[int, MemoryEstimate]:
    """Bytes on the first pipeline stage's GPUs for each ZeRO stage 0-3 (1F1B, m >= p
    microbatches, so that stage holds p of them), by `minidist.planner.stage_memory`."""
    if seq_len is not None:
        model = replace(model, seq_len=seq_len)
    if model.layers % pp:
        raise ValueError(f"pp={pp} does not divide layers={model.layers}: stages need equal "
                         "numbers of layers")
    return {zero: stage_memory(Layout(tp, pp, dp, zero, micro_batch, pp, recompute), model, 0)
            for zero in range(4)}


PARTS = (("params", "parameters", "tab:blue"), ("grads", "gradients", "tab:orange"),
         ("optimizer", "optimizer state", "tab:green"), ("activations", "activations", "tab:red"))


def draw_memory(estimates: dict[int, MemoryEstimate], gpu_memory: float,
                selected: int | None = None, title: str = "") -> Figure:
    """Stacked bars of params, grads, optimizer state and activations per ZeRO stage, in GB,
    with the GPU's memory as a dashed line; the `selected` stage is outlined."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    stages = sorted(estimates)
    bottoms = [0.0] * len(stages)
    for attribute, label, color in PARTS:
        heights = [getattr(estimates[s], attribute) / memory.GB for s in stages]
        ax.bar([f"ZeRO-{s}" for s in stages], heights, bottom=bottoms, label=label, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for i, s in enumerate(stages):
        ax.text(i, bottoms[i], f"{bottoms[i]:.1f}", ha="center", va="bottom", fontsize=8)
        if s == selected:
            ax.bar(i, bottoms[i], fill=False, edgecolor="black", linewidth=2.5)
    ax.axhline(gpu_memory / memory.GB, color="black", linestyle="--",
               label=f"GPU memory ({gpu_memory / memory.GB:.0f} GB)")
    ax.set_ylabel("GB per GPU (1 GB = 1e9 bytes)")
    ax.set_ylim(0, max(max(bottoms), gpu_memory / memory.GB) * 1.15)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# --- Pipeline timelines -----------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One pass on one stage: kind "F", "B" (the whole backward, or its input part when W is
    separate) or "W", of `microbatch` on model chunk `chunk`."""

    stage: int
    start: float
    end: float
    kind: str
    microbatch: int
    chunk: int = 0


def _stage_orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per stage, its (kind, chunk, microbatch) passes in the order it runs them."""
    orders = []
    for i in range(p):
        if schedule == "gpipe":
            order = [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
        elif schedule in ("1f1b", "zb-h1"):
            warmup = min(p - i - 1, m)
            order = [("F", 0, k) for k in range(warmup)]
            # ZB-H1 defers each W by i microbatches: stage i then holds p in flight, like the
            # first stage of 1F1B, and the deferred Ws fill the cool-down bubble.
            lag = i if schedule == "zb-h1" else None
            next_w = 0
            for k in range(m):
                if k < m - warmup:
                    order.append(("F", 0, warmup + k))
                order.append(("B", 0, k))
                if lag is not None and k >= lag:
                    order.append(("W", 0, next_w))
                    next_w += 1
            if lag is not None:
                order += [("W", 0, k) for k in range(next_w, m)]
        else:  # interleaved, Megatron's order: groups of p microbatches, chunk by chunk
            def forward(k: int) -> tuple[int, int]:
                return (k % (p * v)) // p, (k // (p * v)) * p + k % p

            total = v * m
            warmup = min((p - i - 1) * 2 + (v - 1) * p, total)
            order = [("F", *forward(k)) for k in range(warmup)]
            for k in range(total):
                if k < total - warmup:
                    order.append(("F", *forward(warmup + k)))
                chunk, mb = forward(k)
                order.append(("B", v - 1 - chunk, mb))
        orders.append(order)
    return orders


def pipeline_timeline(schedule: str, stages: int, microbatches: int,
                      chunks: int = 1) -> list[Op]:
    """Simulate one step of `schedule` ("gpipe", "1f1b", "interleaved", "zb-h1")."""
    if schedule == "zb-h2":
        raise ValueError("schedule='zb-h2' has no timeline here; minidist.pipeline draws it")
    memory.bubble_time(schedule, stages, microbatches, chunks)  # validates the arguments
    p, m, v = stages, microbatches, chunks
    split = schedule == "zb-h1"
    cost = {"F": 1 / v, "B": (1 if split else 2) / v, "W": 1 / v}
    orders = _stage_orders(schedule, p, m, v)
    finished: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, microbatch)
    free, position, ops = [0.0] * p, [0] * p, []

    def inputs(kind: str, virtual: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", virtual - 1, mb)] if virtual else []
        if kind == "B":
            after = [("B", virtual + 1, mb)] if virtual < p * v - 1 else []
            return [("F", virtual, mb)] + after
        return [("B", virtual, mb)]

    while any(position[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            while position[i] < len(orders[i]):
                kind, chunk, mb = orders[i][position[i]]
                virtual = chunk * p + i
                needed = inputs(kind, virtual, mb)
                if any(key not in finished for key in needed):
                    break
                start = max([free[i]] + [finished[key] for key in needed])
                free[i] = start + cost[kind]
                finished[(kind, virtual, mb)] = free[i]
                ops.append(Op(i, start, free[i], kind, mb, chunk))
                position[i] += 1
                progressed = True
        if not progressed:  # a wrong order would wait forever; the schedules above never do
            raise RuntimeError(f"{schedule} order deadlocks at positions {position}")
    return ops


def timeline_bubble(ops: list[Op]) -> float:
    """Idle share of the timeline: 1 - busy time / (stages x makespan)."""
    stages = 1 + max(op.stage for op in ops)
    makespan = max(op.end for op in ops)
    return 1 - sum(op.end - op.start for op in ops) / (stages * makespan)


def peak_inflight(ops: list[Op], stage: int) -> int:
    """Most (chunk-)microbatches whose activations `stage` holds at once: forwards run minus
    passes that release them (B, or W when the backward is split)."""
    split = any(op.kind == "W" for op in ops)
    release = "W" if split else "B"
    held = peak = 0
    for op in sorted((op for op in ops if op.stage == stage), key=lambda op: op.start):
        held += 1 if op.kind == "F" else -1 if op.kind == release else 0
        peak = max(peak, held)
    return peak


COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def draw_timeline(ops: list[Op], title: str = "") -> Figure:
    """Gantt chart: one row per stage, one box per pass, labelled with its microbatch."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    stages = 1 + max(op.stage for op in ops)
    makespan = max(op.end for op in ops)
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * stages))
    label = len(ops) <= 400
    for op in ops:
        shade = 1.0 - 0.35 * op.chunk / max(1, max(o.chunk for o in ops))
        ax.add_patch(Rectangle((op.start, op.stage - 0.4), op.end - op.start, 0.8,
                               facecolor=COLORS[op.kind], alpha=shade, edgecolor="white"))
        if label:
            ax.text((op.start + op.end) / 2, op.stage, str(op.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_xlim(0, makespan)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks(range(stages), [f"stage {i}" for i in range(stages)], fontsize=8)
    ax.set_xlabel("time (T_F = 1)")
    ax.set_title(title, fontsize=9)
    kinds = sorted({op.kind for op in ops}, key="FBW".index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# --- Widgets ----------------------------------------------------------------------------------


class _Calculator:
    """Controls, an output area, and `update()` rerun whenever a control moves."""

    def __init__(self, controls: dict) -> None:
        import ipywidgets as widgets

        self.controls = controls
        self.output = widgets.Output()
        self.figure: Figure | None = None
        self.message = ""
        for control in controls.values():
            control.observe(lambda change: self.update(), names="value")
        self.widget = widgets.VBox([widgets.HBox(list(controls.values())[:4]),
                                    widgets.HBox(list(controls.values())[4:]), self.output])
        self.update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def compute(self) -> tuple[object, Figure, str]:
        raise NotImplementedError

    def update(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import clear_output, display

        try:
            self.data, self.figure, self.message = self.compute()
        except ValueError as error:
            self.data, self.figure, self.message = None, None, f"Not possible: {error}"
        with self.output:
            clear_output(wait=True)
            print(self.message)
            if self.figure is not None:
                display(self.figure)
        if self.figure is not None:
            plt.close(self.figure)  # shown in the output area only, not again by the inline backend


class MemoryCalculator(_Calculator):
    """Bytes per GPU for a model, ZeRO stage, DP size N, TP, PP, sequence length, micro-batch
    and recompute; bars for every ZeRO stage, the selected one outlined."""

    def __init__(self, model: str = "7B", zero_stage: int = 0, dp: int = 8, tp: int = 1,
                 pp: int = 1, seq_len: int = 4096, micro_batch: int = 1,
                 recompute: str | None = None, gpu_memory_gb: int = 80) -> None:
        import ipywidgets as w

        def powers(low: int, high: int) -> list[int]:
            return [2**k for k in range(low, high + 1)]

        style = {"description_width": "initial"}
        super().__init__({
            "model": w.SelectionSlider(options=list(MODELS), value=model, description="model",
                                       style=style),
            "zero_stage": w.IntSlider(zero_stage, 0, 3, description="ZeRO stage", style=style),
            "dp": w.SelectionSlider(options=powers(0, 10), value=dp, description="N (DP)",
                                    style=style),
            "tp": w.SelectionSlider(options=powers(0, 4), value=tp, description="TP",
                                    style=style),
            "pp": w.SelectionSlider(options=powers(0, 4), value=pp, description="PP",
                                    style=style),
            "seq_len": w.SelectionSlider(options=powers(9, 15), value=seq_len,
                                         description="sequence", style=style),
            "micro_batch": w.SelectionSlider(options=powers(0, 4), value=micro_batch,
                                             description="micro-batch", style=style),
            "recompute": w.Dropdown(options=[("none", None), ("selective", "selective"),
                                             ("full", "full")], value=recompute,
                                    description="recompute", style=style),
            "gpu_memory_gb": w.SelectionSlider(options=[24, 40, 80, 141], value=gpu_memory_gb,
                                               description="GPU GB", style=style),
        })

    def compute(self) -> tuple[dict[int, MemoryEstimate], Figure, str]:
        v = self.values()
        model = MODELS[v["model"]]
        estimates = rank_memory(model, v["dp"], v["tp"], v["pp"], v["seq_len"],
                                v["micro_batch"], v["recompute"])
        gpu = v["gpu_memory_gb"] * memory.GB
        chosen = estimates[v["zero_stage"]]
        verdict = "fits" if chosen.total <= gpu else "does NOT fit"
        message = (f"{v['model']} ({model.num_params / 1e9:g}B params), ZeRO-{v['zero_stage']}, "
                   f"N={v['dp']}, TP={v['tp']}, PP={v['pp']}: {chosen.total / memory.GB:.1f} GB "
                   f"per GPU on the first stage, {verdict} in {v['gpu_memory_gb']} GB")
        title = (f"{v['model']}, s={v['seq_len']}, b={v['micro_batch']}, "
                 f"recompute={v['recompute']}")
        return estimates, draw_memory(estimates, gpu, v["zero_stage"], title), message


class BubbleExplorer(_Calculator):
    """A schedule's timeline for p stages, m microbatches and v chunks, with its bubble
    measured on the timeline and given by `minidist.memory.bubble_fraction`."""

    def __init__(self, schedule: str = "1f1b", stages: int = 4, microbatches: int = 8,
                 chunks: int = 1) -> None:
        import ipywidgets as w

        super().__init__({
            "schedule": w.Dropdown(options=["gpipe", "1f1b", "interleaved", "zb-h1"],
                                   value=schedule, description="schedule"),
            "stages": w.IntSlider(stages, 1, 8, description="p"),
            "microbatches": w.IntSlider(microbatches, 1, 32, description="m"),
            "chunks": w.IntSlider(chunks, 1, 4, description="v"),
        })

    def compute(self) -> tuple[list[Op], Figure, str]:
        v = self.values()
        args = (v["schedule"], v["stages"], v["microbatches"],
                v["chunks"] if v["schedule"] == "interleaved" else 1)
        ops = pipeline_timeline(*args)
        measured = timeline_bubble(ops)
        formula = memory.bubble_fraction(*args)
        relative = memory.bubble_relative_to_ideal(*args)
        message = (f"bubble: {measured:.1%} of the timeline measured, {formula:.1%} by "
                   f"bubble_fraction (share of total time); {relative:.1%} relative to ideal")
        title = f"{args[0]}: p={args[1]}, m={args[2]}" + (f", v={args[3]}" if args[3] > 1 else "")
        return ops, draw_timeline(ops, title), message
