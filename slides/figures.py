"""Every figure the slide decks show, drawn at build time from minidist's own code.

A deck's Markdown names a figure as `![alt text](figure:<name>)`; `FIGURES` maps each name to
a function returning a matplotlib Figure. All of the slides' `minidist` imports live in this
file, so that a renamed module is fixed in one place.

Figures must rebuild to what they showed (`build.py --check` compares the committed decks with
a fresh build): they come from formulas, the alpha-beta model and minidist's simulators, never
from a measurement. The check compares each figure's `fingerprint` (its texts and data), not
its PNG: the same figure renders to other pixels on a machine with other fonts.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from minidist.communication.comm import chunk_bounds  # noqa: E402
from minidist.communication.mesh import group_ranks  # noqa: E402
from minidist.communication.network import TwoTier, hierarchical_bytes  # noqa: E402
from minidist.core.timeline import Event, plot_events  # noqa: E402
from minidist.costs import algorithms, flops, memory, tiers, traffic  # noqa: E402
from minidist.costs.cost import (  # noqa: E402
    all_reduce_time,
    busbw_factor,
    collective_time,
    crossover_size,
    parameter_server_time,
    ring_bytes_sent,
)
from minidist.costs.overlap import modelled_step  # noqa: E402
from minidist.costs.planner import MODELS, Cluster  # noqa: E402
from minidist.jobs.profiling import ProfileTimeline  # noqa: E402
from minidist.parallel import fsdp1, moe, pipeline, pipeline_simulator  # noqa: E402
from minidist.parallel.context_parallel import LAYOUTS, forward_times, positions  # noqa: E402
from minidist.parallel.ddp import assign_buckets, plot_timeline  # noqa: E402
from minidist.parallel.param_server import stale_gradient_descent  # noqa: E402
from minidist.pictures import gantt  # noqa: E402
from minidist.pictures.diagrams import (  # noqa: E402
    draw_collectives,
    draw_linear_splits,
    draw_mesh_groups,
    draw_ring,
    draw_roofline,
    draw_tensor_parallel_mlp,
    draw_two_tiers,
)
from minidist.pictures.widgets import (  # noqa: E402
    draw_memory,
    memory_by_zero_stage,
    memory_on_one_device,
)

GB = memory.GB
H100 = Cluster.dgx_h100(64)
STYLE = {"font.size": 12, "axes.titlesize": 13, "axes.titlelocation": "left",
         "axes.spines.top": False, "axes.spines.right": False}
COLORS = plt.get_cmap("tab10")


def png_bytes(figure: Figure, dpi: int = 130) -> bytes:
    """The figure as PNG, identical on every build (no date, no software stamp)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight",
                   metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def _box(ax: Axes, x: float, y: float, w: float, h: float, text: str, color: str = "0.9",
         size: int = 12, **text_args) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="0.3", lw=1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, **text_args)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], color: str = "0.2",
           style: str = "-|>", **kwargs) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=16, color=color,
                                 lw=1.6, **kwargs))


def _canvas(width: float, height: float, xlim: tuple[float, float],
            ylim: tuple[float, float]) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    return fig, ax


# --- Lab 00: processes and ranks ---------------------------------------------------------------


def model_state_against_gpu() -> Figure:
    """Why one device is not enough: 16 bytes per parameter against one 80 GB GPU."""
    fig, ax = plt.subplots(figsize=(10, 4))
    names = ["1.3B", "7B", "13B", "70B"]
    for i, name in enumerate(names):
        state = memory.model_state_bytes(MODELS[name].num_params)
        bottom = 0.0
        for j, (part, label) in enumerate((("params", "parameters (bf16)"),
                                           ("grads", "gradients (bf16)"),
                                           ("optimizer", "fp32 master, Adam m and v"))):
            value = getattr(state, part) / GB
            ax.bar(i, value, bottom=bottom, color=COLORS(j), label=label if i == 0 else None)
            bottom += value
        ax.text(i, bottom, f"{bottom:,.0f} GB", ha="center", va="bottom")
    ax.axhline(80, color="black", ls="--", label="one 80 GB GPU")
    ax.set_xticks(range(len(names)), [f"{n} parameters" for n in names])
    ax.set_ylim(0, 1250)
    ax.set_ylabel("GB of model state")
    ax.set_title("Model state alone (mixed-precision Adam, 16 bytes per parameter)")
    ax.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    return fig


def spmd_ranks() -> Figure:
    """One program, N processes, each with its own memory, differing only by rank."""
    fig, ax = _canvas(10, 3.6, (0, 10), (0, 4))
    _box(ax, 3.5, 3.0, 3, 0.8, "hello(rank, world_size)\none function", "#fde9b6")
    for rank in range(4):
        x = 0.3 + rank * 2.45
        _arrow(ax, (5, 3.0), (x + 1.0, 2.2))
        _box(ax, x, 0.4, 2.0, 1.8, f"process\nrank {rank} of 4\n\nown memory,\nown copy of data",
             matplotlib.colors.to_hex(COLORS(rank), keep_alpha=False) + "55", size=11)
    ax.text(5, -0.05, "same code everywhere; behaviour differs only through `rank`",
            ha="center", style="italic")
    return fig


def rendezvous() -> Figure:
    """Ranks meet through a key-value store, then talk directly."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("1. meet: register at the store", "2. talk: tensors flow "
                                "rank to rank"), strict=True):
        ax.set_xlim(0, 6)
        ax.set_ylim(0, 5)
        ax.axis("off")
        ax.set_title(phase, fontsize=13)
        spots = [(0.3, 3.6), (4.2, 3.6), (0.3, 0.4), (4.2, 0.4)]
        for rank, (x, y) in enumerate(spots):
            _box(ax, x, y, 1.5, 0.9, f"rank {rank}", matplotlib.colors.to_hex(COLORS(rank)) + "55")
        if phase.startswith("1"):
            _box(ax, 1.9, 2.0, 2.2, 1.0, "TCP store\nMASTER_ADDR:PORT", "#fde9b6", size=11)
            for x, y in spots:
                _arrow(ax, (x + 0.75, y + (0 if y > 2 else 0.9)), (3.0, 2.5 + (0.5 if y > 2
                                                                                  else -0.5)))
        else:
            for start, end in (((1.8, 4.05), (4.2, 4.05)), ((1.8, 0.85), (4.2, 0.85)),
                               ((1.05, 3.6), (1.05, 1.3)), ((4.95, 3.6), (4.95, 1.3))):
                _arrow(ax, start, end, style="<|-|>", color="tab:blue")
            ax.text(3, 2.5, "gloo (CPU)\nNCCL (GPU)", ha="center", va="center", fontsize=11)
    fig.tight_layout()
    return fig


def deadlock() -> Figure:
    """Two ranks that both receive first wait forever; one that sends first does not."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 4))
    cases = (("deadlock: both ranks call recv first", [("recv(src=1)", 0, 10, "tab:red"),
                                                       ("recv(src=0)", 0, 10, "tab:red")]),
             ("fixed: rank 0 sends first, rank 1 receives first",
              [("send(dst=1)", 0, 2, "tab:blue"), ("recv(src=0)", 0, 2, "tab:green")]))
    for ax, (title, rows) in zip(axes, cases, strict=True):
        for rank, (label, start, end, color) in enumerate(rows):
            y = 1 - rank
            ax.barh(y, end - start, left=start, color=color, alpha=0.6, height=0.6)
            ax.text(start + 0.15, y, label, va="center", fontsize=11)
        if rows[0][2] == 10:
            ax.text(9.9, 0.5, "… waiting forever (until the timeout)", ha="right", va="center",
                    fontsize=11, style="italic")
        else:
            _arrow(ax, (1.8, 1), (1.8, 0), color="black")
            ax.text(2.2, 0.5, "tensor arrives, both continue", va="center", fontsize=11)
        ax.set_yticks([1, 0], ["rank 0", "rank 1"])
        ax.set_xlim(0, 10)
        ax.set_xticks([])
        ax.set_title(title, fontsize=12)
    axes[1].set_xlabel("time →")
    fig.tight_layout()
    return fig


def send_recv() -> Figure:
    """minidist's before/after picture of a point-to-point send."""
    return draw_collectives(["send_recv"], world_size=2)


# --- Lab 01: collectives -----------------------------------------------------------------------


def ring_phases() -> Figure:
    """The ring and what each phase must leave on each rank, without the order of the chunks:
    which chunk moves at which step is Lab 01's Exercise 2."""
    return draw_ring(4)


def ring_reduce_scatter_steps(n: int = 4) -> Figure:
    """The reduce-scatter phase of ring all-reduce, step by step, with minidist's indexing
    (rank r sends chunk r-step-1 to r+1 and adds chunk r-step-2 from r-1): each box says
    which ranks' contributions a chunk holds."""
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk] = ranks summed
    snapshots = [[[set(c) for c in row] for row in held]]
    sent = []
    for step in range(n - 1):
        incoming = [(r, (r - step - 2) % n, held[(r - 1) % n][(r - step - 2) % n])
                    for r in range(n)]
        sent.append([(r - step - 1) % n for r in range(n)])
        for r, chunk, contribution in incoming:
            held[r][chunk] = held[r][chunk] | contribution
        snapshots.append([[set(c) for c in row] for row in held])
    fig, axes = plt.subplots(1, n, figsize=(12, 3.8))
    letters = "abcdefgh"
    for k, ax in enumerate(axes):
        ax.set_xlim(-1.2, n)
        ax.set_ylim(-0.6, n + 0.2)
        ax.axis("off")
        ax.set_title("start" if k == 0 else f"after step {k}", fontsize=12)
        for r in range(n):
            y = n - 1 - r
            ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=10)
            for c in range(n):
                count = len(snapshots[k][r][c])
                full = count == n
                ax.add_patch(Rectangle((c, y), 0.9, 0.8, facecolor=COLORS(c),
                                       alpha=0.2 + 0.7 * count / n, edgecolor="0.3",
                                       lw=2.5 if full else 0.8))
                label = f"Σ{letters[c]}" if full else f"{letters[c]}×{count}"
                ax.text(c + 0.45, y + 0.4, label, ha="center", va="center", fontsize=10,
                        fontweight="bold" if full else "normal")
            if k < n - 1:
                chunk = sent[k][r]
                ax.add_patch(Rectangle((chunk - 0.04, y - 0.04), 0.98, 0.88, fill=False,
                                       edgecolor="black", lw=1.5, ls="--"))
    fig.suptitle(f"ring reduce-scatter, N = {n}: dashed = the chunk each rank sends right next; "
                 f"a×k = chunk a summed over k ranks", fontsize=12, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def ring_bytes_against_n() -> Figure:
    """Bytes each rank sends in ring all-reduce, 2(N-1)/N·S, and two common misstatements."""
    fig, ax = plt.subplots(figsize=(10, 4))
    ns = list(range(2, 65))
    ax.plot(ns, [ring_bytes_sent("all_reduce", 1.0, n) for n in ns], lw=3,
            label="ring all-reduce: 2(N−1)/N · S  (correct)")
    ax.plot(ns, [2.0] * len(ns), ls="--", color="0.4", label="“2S whatever N is”")
    ax.plot(ns, [2.0 / n for n in ns], ls=":", color="tab:red", label="“divided by N” (wrong)")
    for n, place in ((2, (2.9, 0.95)), (3, (4.5, 1.22)), (16, (20, 1.6))):
        value = ring_bytes_sent("all_reduce", 1.0, n)
        ax.annotate(f"N={n}: {value:.2f} S", (n, value), place,
                    arrowprops={"arrowstyle": "->"}, fontsize=11)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes sent per rank / S")
    ax.set_ylim(0, 2.3)
    ax.set_title("Per-rank traffic of ring all-reduce hardly grows with N")
    ax.legend(fontsize=10, loc="lower right")
    fig.tight_layout()
    return fig


def _sizes() -> list[float]:
    return [2.0 ** k for k in range(10, 31)]


ALPHA, BANDWIDTH = 20e-6, 10e9  # an illustrative link: 20 µs latency, 10 GB/s


def alpha_beta_time() -> Figure:
    """Ring all-reduce time from the alpha-beta model: latency-bound, then bandwidth-bound."""
    fig, ax = plt.subplots(figsize=(10, 4))
    sizes = _sizes()
    for n in (2, 8, 32):
        ax.plot(sizes, [collective_time("all_reduce", s, n, ALPHA, 1 / BANDWIDTH) * 1e3
                        for s in sizes], lw=2.5, label=f"N = {n}")
    ax.axvspan(sizes[0], 64e3, color="tab:orange", alpha=0.12)
    ax.axvspan(64e6, sizes[-1], color="tab:blue", alpha=0.10)
    ax.text(1.5e3, 4, "latency-bound:\nthe α of each step\ndominates", fontsize=11)
    ax.text(7e7, 0.06, "bandwidth-bound:\nthe bytes\ndominate", fontsize=11)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"α-β model, ring all-reduce: α = {ALPHA * 1e6:.0f} µs, "
                 f"1/β = {BANDWIDTH / 1e9:.0f} GB/s")
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(0.05, 1.0))
    fig.tight_layout()
    return fig


def all_reduce_algorithms() -> Figure:
    """Predicted all-reduce time per algorithm on 8 ranks, and where the fastest changes."""
    n, beta = 8, 1 / BANDWIDTH
    fig, ax = plt.subplots(figsize=(10, 4))
    sizes = _sizes()
    for algorithm in algorithms.names("all_reduce", nodes=False):
        ax.plot(sizes, [all_reduce_time(algorithm, s, n, ALPHA, beta) * 1e3 for s in sizes],
                lw=2.5, label=algorithm.replace("_", " "))
    crossover = crossover_size("recursive_doubling", "rabenseifner", n, ALPHA, beta)
    ax.axvline(crossover, color="0.4", ls=":", lw=1.5)
    ax.text(crossover * 1.3, 8, "recursive doubling\nand Rabenseifner\ncross", fontsize=11)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"α-β model, all-reduce on N = {n}: α = {ALPHA * 1e6:.0f} µs, "
                 f"1/β = {BANDWIDTH / 1e9:.0f} GB/s")
    ax.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    return fig


def algbw_busbw() -> Figure:
    """algbw falls with N at a fixed link speed; busbw stays comparable with the link."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.9), sharey=True)
    sizes = _sizes()
    for n in (2, 8, 32):
        times = [collective_time("all_reduce", s, n, ALPHA, 1 / BANDWIDTH) for s in sizes]
        algbw = [s / t / 1e9 for s, t in zip(sizes, times, strict=True)]
        axes[0].plot(sizes, algbw, lw=2.5, label=f"N = {n}")
        axes[1].plot(sizes, [a * busbw_factor("all_reduce", n) for a in algbw], lw=2.5,
                     label=f"N = {n}")
    for ax, title in zip(axes, ("algbw = S / t", "busbw = algbw × 2(N−1)/N"), strict=True):
        ax.axhline(BANDWIDTH / 1e9, color="black", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size S (bytes)")
        ax.set_title(title)
        ax.legend(fontsize=10, loc="upper left")
    axes[1].text(2e3, BANDWIDTH / 1e9 * 1.03, "link: 10 GB/s", fontsize=10)
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    return fig


def collectives_part_one() -> Figure:
    return draw_collectives(["broadcast", "reduce", "all_reduce"], world_size=3)


def collectives_part_two() -> Figure:
    return draw_collectives(["all_gather", "reduce_scatter", "send_recv"], world_size=3)


def reduce_scatter_then_all_gather() -> Figure:
    return draw_collectives(["reduce_scatter", "all_gather"], world_size=3)


# --- Lab 02: one device and one link -----------------------------------------------------------


def sixteen_bytes() -> Figure:
    """Where mixed-precision Adam's 16 bytes per parameter go."""
    fig, ax = plt.subplots(figsize=(10, 3))
    recipe, per_param = memory.PRECISIONS["bf16-mixed"], memory.bytes_per_param()
    parts = (("bf16\nparams", recipe.param), ("bf16\ngrads", recipe.grad),
             ("fp32 master\nweights", recipe.master), ("Adam m\n(fp32)", recipe.state),
             ("Adam v\n(fp32)", recipe.state))
    left = 0.0
    for i, (label, value) in enumerate(parts):
        ax.barh(0, value, left=left, color=COLORS(i), edgecolor="white")
        ax.text(left + value / 2, 0, f"{label}\n{value:g} B", ha="center", va="center",
                fontsize=11)
        left += value
    ax.set_xlim(0, 16)
    ax.set_yticks([])
    ax.set_xticks(range(0, 17, 2))
    ax.set_xlabel("bytes per parameter")
    ax.set_title(f"Mixed-precision Adam: {per_param.total:g} bytes per parameter "
                 "(ZeRO §3, K = 12)")
    fig.tight_layout()
    return fig


ONE_DEVICE_LAYER = MODELS["7B"]  # the layer of the one-device slides: h = 4096, a = 32


def activations_one_device() -> Figure:
    """One 7B layer's activations on one device (Korthikanti Table 2), by sequence length and
    recompute choice: the s² attention core, and what recompute keeps of it."""
    h, a = ONE_DEVICE_LAYER.hidden, ONE_DEVICE_LAYER.heads
    lengths = (2048, 4096, 8192)
    choices = (("keep everything", None), ("selective recompute", "selective"),
               ("full recompute", "full"))
    fig, ax = plt.subplots(figsize=(10, 3.9))
    width = 0.27
    for k, (label, recompute) in enumerate(choices):
        values = [memory.activation_bytes(s, 1, h, a, recompute=recompute) / GB for s in lengths]
        bars = ax.bar([i + (k - 1) * width for i in range(len(lengths))], values, width,
                      color=COLORS(k), label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=10)
    ax.set_xticks(range(len(lengths)), [f"s = {s}" for s in lengths])
    ax.set_ylabel("GB kept per layer")
    ax.set_title(f"One layer (h = {h}, a = {a}, b = 1, 16-bit): the attention core grows as s²")
    ax.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    return fig


def recompute_schedule() -> Figure:
    """A step of 4 layers, plain and with full recompute, schematic: forward keeps each
    layer's input only; backward runs each layer's forward again just before its backward."""
    fig, ax = _canvas(11, 2.9, (-2.3, 19.5), (-0.3, 2.6))
    lanes = (("plain", 1.5, False), ("full recompute", 0.2, True))
    for name, y, again in lanes:
        ax.text(-0.2, y + 0.35, name, ha="right", va="center", fontsize=11)
        t = 0.0
        for layer in range(4):
            _box(ax, t, y, 1.0, 0.7, f"F{layer}", "#cfe3f3", size=10)
            t += 1.0
        for layer in reversed(range(4)):
            if again:
                _box(ax, t, y, 1.0, 0.7, f"F{layer}", "#f6d8a8", size=10)
                t += 1.0
            _box(ax, t, y, 2.0, 0.7, f"B{layer}", "#d9cdea", size=10)
            t += 2.0
    ax.text(0, 2.35, "blue: forward   purple: backward (about twice a forward)   "
            "orange: the forward run again, with autograd recording", fontsize=10)
    return fig


def one_gpu_memory() -> Figure:
    """minidist's one-GPU calculator: 1.3B trained alone, each recompute choice."""
    return draw_memory(memory_on_one_device(MODELS["1.3B"], seq_len=4096), H100.gpu_memory,
                       selected="selective", name=lambda choice: f"recompute: {choice}",
                       title="1.3B alone on one 80 GB GPU, s = 4096, b = 1: GB by recompute "
                             "choice")


LINKS = {"NVLink 4, α = 5 µs": (5e-6, 450e9), "InfiniBand NDR, α = 10 µs": (10e-6, 50e9),
         "a laptop's loopback, α = 50 µs": (50e-6, 1e9)}


def link_bandwidth() -> Figure:
    """The bandwidth one message gets on an α-β link, S / (α + S·β), against its size."""
    fig, ax = plt.subplots(figsize=(10, 3.9))
    sizes = [2.0 ** k for k in range(8, 34)]
    for k, (name, (alpha, bandwidth)) in enumerate(LINKS.items()):
        got = [s / (alpha + s / bandwidth) / 1e9 for s in sizes]
        ax.plot(sizes, got, lw=2.5, color=COLORS(k), label=f"{name}, {bandwidth / 1e9:g} GB/s")
        ax.axhline(bandwidth / 1e9, color=COLORS(k), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("GB/s the message gets")
    ax.set_title("One message on an α-β link: S / (α + S·β); dotted: the link's 1/β")
    ax.legend(fontsize=10, loc="lower right")
    fig.tight_layout()
    return fig


def roofline_h100() -> Figure:
    """An H100's peak against its memory and two of its links, as rooflines."""
    peak = H100.peak_flops
    return draw_roofline({"H100 and its HBM3, 3.35 TB/s": (peak, 3.35e12),
                          "H100, NVLink 4, 450 GB/s each way": (peak, 450e9),
                          "H100, InfiniBand NDR, 50 GB/s": (peak, 50e9)},
                         title="989 TFLOP/s (dense bf16) against a memory and two links")


# --- Lab 03: data parallel ---------------------------------------------------------------------

LAYERS, TENSORS_PER_LAYER = 8, 16
LAYER_BYTES = [6e6, 6e6, 24e6, 24e6, 24e6, 24e6, 24e6, 24e6]  # in parameters() order
BACKWARD_PER_LAYER = 2e-3  # seconds
DP_RANKS = 4
DP_ALPHA, DP_BANDWIDTH = 50e-6, 25e9


def _all_reduce_time(nbytes: float) -> float:
    return collective_time("all_reduce", nbytes, DP_RANKS, DP_ALPHA, 1 / DP_BANDWIDTH)


def _tensors() -> list[tuple[float, float]]:
    """(ready time, bytes) of each gradient tensor, in parameters() order: backward runs from
    the last layer to the first, and a layer's tensors are ready when the layer is done."""
    return [((LAYERS - layer) * BACKWARD_PER_LAYER, LAYER_BYTES[layer] / TENSORS_PER_LAYER)
            for layer in range(LAYERS) for _ in range(TENSORS_PER_LAYER)]


def _serial(launches: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(ready, duration) all-reduces run one after another on the link: (start, end)."""
    spans, free = [], 0.0
    for ready, duration in launches:
        start = max(ready, free)
        free = start + duration
        spans.append((start, free))
    return spans


def _bucketed_spans(cap_bytes: float) -> list[tuple[float, float]]:
    """(start, end) of each bucket's all-reduce, buckets filled in gradient-arrival order."""
    arrival = list(reversed(_tensors()))
    buckets = assign_buckets([int(nbytes) for _, nbytes in arrival], int(cap_bytes))
    return _serial([(max(arrival[i][0] for i in bucket),
                     _all_reduce_time(sum(arrival[i][1] for i in bucket))) for bucket in buckets])


def _end_of_backward() -> float:
    return max(ready for ready, _ in _tensors())


def ddp_bucket_timeline() -> Figure:
    """minidist.parallel.ddp.plot_timeline on a modelled backward: 8 layers, 50 MB buckets."""
    events = [Event(0, "gradient", "", ready, ready) for ready, _ in reversed(_tensors())]
    events += [Event(0, "all_reduce", f"bucket {index}", start, end)
               for index, (start, end) in enumerate(_bucketed_spans(50e6))]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    plot_timeline(events, ax=ax, title="bucketed DDP, modelled: 8 layers (2 ms of backward "
                                       "each), 50 MB buckets, N = 4")
    fig.tight_layout()
    return fig


def ddp_three_versions() -> Figure:
    """Step timelines of the three DDP versions on the same modelled backward."""
    end = _end_of_backward()
    rows = (("naive: one all-reduce\nper tensor, after backward",
             _serial([(end, _all_reduce_time(nbytes)) for _, nbytes in _tensors()])),
            ("one flat buffer,\nafter backward",
             _serial([(end, _all_reduce_time(sum(nbytes for _, nbytes in _tensors())))])),
            ("bucketed, overlapped\n(50 MB buckets)", _bucketed_spans(50e6)))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    finishes = []
    for y, (_, spans) in enumerate(rows):
        ax.barh(y, end * 1e3, color="tab:blue", alpha=0.35, height=0.7,
                label="backward compute" if y == 0 else None)
        for k, (start, stop) in enumerate(spans):
            ax.barh(y, (stop - start) * 1e3, left=start * 1e3, color="tab:orange",
                    edgecolor="white", linewidth=0.3, height=0.35,
                    label="all-reduce" if y == 0 and k == 0 else None)
        finishes.append(max(stop for _, stop in spans) * 1e3)
        ax.text(finishes[-1] + 0.5, y, f"{finishes[-1]:.1f} ms", va="center", fontsize=11)
    ax.set_yticks(range(3), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(finishes) * 1.15)
    ax.set_xlabel(f"ms since backward started ({len(_tensors())} gradient tensors; α-β model: "
                  "α = 50 µs, 25 GB/s, N = 4)")
    ax.set_title("Same gradients, same bytes: only the number of messages and the overlap differ")
    ax.legend(fontsize=10, loc="lower right")
    fig.tight_layout()
    return fig


def data_parallel_split() -> Figure:
    """One global batch, N slices, N identical models, one all-reduce of the gradients."""
    fig, ax = _canvas(11, 4, (0, 11), (0, 4.6))
    _box(ax, 0.2, 3.6, 10.6, 0.7, "global batch of N·B samples", "#fde9b6")
    for r in range(4):
        x = 0.3 + r * 2.7
        color = matplotlib.colors.to_hex(COLORS(r)) + "55"
        _arrow(ax, (x + 1.1, 3.6), (x + 1.1, 3.05))
        _box(ax, x, 2.35, 2.2, 0.7, f"B samples → rank {r}", color, size=11)
        _box(ax, x, 1.25, 2.2, 0.9, "full model copy\nforward + backward", "0.93", size=11)
        _arrow(ax, (x + 1.1, 1.25), (x + 1.1, 0.95))
    _box(ax, 0.3, 0.2, 10.4, 0.75, "all-reduce gradients, divide by N → identical step on "
         "every rank", "#cfe3f3")
    return fig


def no_sync_timeline() -> Figure:
    """Gradient accumulation: k - 1 backwards under no_sync() send nothing."""
    fig, ax = plt.subplots(figsize=(10, 2.8))
    k, compute = 4, 6.0
    for i in range(k):
        ax.barh(0, compute, left=i * compute, color="tab:blue", alpha=0.35 + 0.12 * i,
                edgecolor="white")
        ax.text(i * compute + compute / 2, 0, f"micro {i}\nfwd + bwd", ha="center", va="center",
                fontsize=11)
        label = "no_sync(): 0 bytes" if i < k - 1 else "all-reduce"
        if i == k - 1:
            ax.barh(-0.8, 4, left=i * compute + 2, color="tab:orange", height=0.5)
        ax.text(i * compute + compute / 2, -0.8, label, ha="center", va="center", fontsize=11)
    ax.barh(0, 1, left=k * compute + 0.2, color="tab:green")
    ax.text(k * compute + 0.7, 0.55, "step", ha="center", fontsize=11)
    ax.set_yticks([0, -0.8], ["compute", "network"])
    ax.set_xticks([])
    ax.set_xlim(0, k * compute + 2)
    ax.set_title(f"Accumulating k = {k} microbatches: only the last backward all-reduces")
    fig.tight_layout()
    return fig


def step_time_against_bucket_size() -> Figure:
    """Finish time of backward + gradient sync against the bucket cap (modelled)."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    caps = [2.0 ** k * 1e6 for k in range(-3, 9)]
    finish = [max(stop for _, stop in _bucketed_spans(cap)) * 1e3 for cap in caps]
    ax.plot([c / 1e6 for c in caps], finish, "o-", lw=2.5)
    ax.axhline(_end_of_backward() * 1e3, color="0.4", ls="--",
               label="backward alone (perfect overlap)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket cap (MB)")
    ax.set_ylabel("backward + sync (ms)")
    ax.set_ylim(0, max(finish) * 1.1)
    ax.set_title("Tiny buckets: many α's; one huge bucket: nothing overlaps")
    ax.legend(fontsize=11, loc="lower left")
    fig.tight_layout()
    return fig


# --- Lab 04: ZeRO and FSDP ---------------------------------------------------------------------


def zero_stages_7_5b() -> Figure:
    """ZeRO's own check: Ψ = 7.5B on N = 64 ranks, 120 / 31.4 / 16.6 / 1.9 GB."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for stage in range(4):
        state = memory.model_state_bytes(7.5e9, stage, 64)
        bottom = 0.0
        for j, part in enumerate(("params", "grads", "optimizer")):
            value = getattr(state, part) / GB
            ax.bar(stage, value, bottom=bottom, color=COLORS(j),
                   label={"params": "parameters", "grads": "gradients",
                          "optimizer": "optimizer state"}[part] if stage == 0 else None)
            bottom += value
        ax.text(stage, bottom + 2, f"{bottom:.1f} GB", ha="center", fontsize=12)
    ax.set_xticks(range(4), ["DDP (stage 0)\n16Ψ", "ZeRO-1\n4Ψ + 12Ψ/N", "ZeRO-2\n2Ψ + 14Ψ/N",
                             "ZeRO-3 / FSDP\n16Ψ/N"])
    ax.set_ylabel("GB per rank")
    ax.set_ylim(0, 140)
    ax.set_title("Ψ = 7.5 B parameters, N = 64 ranks (ZeRO Figure 1)")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig


def memory_bars_7b() -> Figure:
    """minidist's memory calculator: a 7B model on 8 data-parallel ranks, per ZeRO stage."""
    estimates = memory_by_zero_stage(MODELS["7B"], dp=8, recompute="full")
    return draw_memory(estimates, H100.gpu_memory, selected=3,
                       title="7B model (s = 4096, b = 1, full recompute), 8 data-parallel ranks: "
                             "GB per GPU by ZeRO stage")


def comm_volume_by_stage() -> Figure:
    """Bytes each rank sends per step, DDP and ZeRO 1-3 (ring, N = 8, bf16), 7B parameters."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    psi, n = MODELS["7B"].num_params, 8
    names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP"]
    for stage in range(len(names)):
        volume = traffic.data_parallel_traffic(psi, n, stage)
        left = 0.0
        for collective in volume.collectives:
            value = collective.bytes_sent / GB
            color = {"all_reduce": "tab:purple", "reduce_scatter": "tab:orange",
                     "all_gather": "tab:green"}[collective.op]
            ax.barh(stage, value, left=left, color=color, edgecolor="white")
            ax.text(left + value / 2, stage, collective.op.replace("_", "-"), ha="center",
                    va="center", fontsize=10)
            left += value
        ax.text(left + 0.3, stage, f"{left:.1f} GB  ({volume.volume / psi / 2:g}Ψ elements)",
                va="center", fontsize=11)
    ax.set_yticks(range(4), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 40)
    ax.set_xlabel("GB sent per rank per step (7B parameters, bf16, ring over N = 8)")
    ax.set_title("ZeRO-1 and ZeRO-2 send what DDP sends; ZeRO-3 sends 1.5×")
    fig.tight_layout()
    return fig


def zero_sharding_layout() -> Figure:
    """What each of 4 ranks keeps, per ZeRO stage."""
    stages = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP")
    parts = ("params", "grads", "optimizer")
    widths = {"params": 2, "grads": 2, "optimizer": 12}
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.8))
    n = 4
    for stage, (ax, name) in enumerate(zip(axes, stages, strict=True)):
        ax.set_xlim(-0.2, 17)
        ax.set_ylim(-0.5, n + 0.3)
        ax.axis("off")
        ax.set_title(name, fontsize=13)
        for r in range(n):
            y = n - 1 - r
            left = 0.0
            for j, part in enumerate(parts):
                sharded = stage >= {"optimizer": 1, "grads": 2, "params": 3}[part]
                width = widths[part]
                ax.add_patch(Rectangle((left, y), width, 0.8, facecolor="white",
                                       edgecolor="0.6", lw=0.6))
                if sharded:
                    ax.add_patch(Rectangle((left + r * width / n, y), width / n, 0.8,
                                           facecolor=COLORS(j), edgecolor="0.3"))
                else:
                    ax.add_patch(Rectangle((left, y), width, 0.8, facecolor=COLORS(j),
                                           alpha=0.85, edgecolor="0.3"))
                left += width
            kept = memory.model_state_bytes(1.0, stage, n).total
            ax.text(16.3, y + 0.4, f"{kept:g}Ψ", va="center", fontsize=10)
        ax.text(0, -0.45, "rank 0 … 3 top to bottom", fontsize=9, color="0.3")
    fig.suptitle("blue: bf16 params (2Ψ)   orange: bf16 grads (2Ψ)   green: fp32 master, m, v "
                 "(12Ψ); coloured = kept by that rank (N = 4)", fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def zero_memory_against_n() -> Figure:
    """Model state per rank against N, Ψ = 7.5B, against an 80 GB GPU."""
    fig, ax = plt.subplots(figsize=(10, 4))
    ns = [2 ** k for k in range(0, 9)]
    names = ["DDP: 16Ψ", "ZeRO-1: 4Ψ + 12Ψ/N", "ZeRO-2: 2Ψ + 14Ψ/N", "ZeRO-3: 16Ψ/N"]
    for stage, name in enumerate(names):
        ax.plot(ns, [memory.model_state_bytes(7.5e9, stage, n).total / GB for n in ns], "o-",
                lw=2.2, label=name)
    ax.axhline(80, color="black", ls="--", label="80 GB GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("GB of model state per rank")
    ax.set_title("Ψ = 7.5B: only sharded terms shrink with N")
    ax.legend(fontsize=10, loc="lower left")
    fig.tight_layout()
    return fig


def fsdp_unit_timeline() -> Figure:
    """One FSDP step of 4 equal units on one GPU, prefetch on, as `overlap.modelled_step` (Lab
    04's model) schedules it: a gather takes 0.8 of a unit's forward, on two lanes, the GPU's
    compute and the link's collectives."""
    events = modelled_step([1.0] * 4, tokens=1.0, world_size=2, flops_per_s=2.0,
                           link_bytes_per_s=1.25)  # forward 1, gather (1/2)·2 B/1.25 = 0.8
    short = {"forward": "F", "backward": "B", "all_gather": "AG", "reduce_scatter": "RS"}
    fig, ax = plt.subplots(figsize=(11, 3.4))
    colors = {"F": "tab:blue", "B": "tab:purple", "A": "tab:green", "R": "tab:orange"}
    for event in events:
        label, start, end = f"{short[event.kind]} {event.name}", event.start, event.end
        row = 0 if event.kind in ("forward", "backward") else 1
        ax.barh(row, end - start, left=start, color=colors[label[0]], edgecolor="white")
        ax.text((start + end) / 2, row, label, ha="center", va="center", fontsize=10,
                color="white" if row == 0 else "black")
    ax.set_yticks([0, 1], ["compute", "link"])
    ax.set_xlabel("time →   (AG = all-gather a unit's parameters, RS = reduce-scatter its "
                  "gradients)")
    ax.set_xticks([])
    ax.set_title("FSDP, 4 units, modelled: each gather prefetched while the unit before "
                 "computes;\nthe last unit gathered again for backward")
    fig.tight_layout()
    return fig


def fsdp_units_gathered() -> Figure:
    """Which units hold their gathered parameters during each unit's forward (F) and
    backward (B), by the schedule of Lab 04's FSDP: the running unit, plus with prefetch the
    next one in that direction."""
    names = ["tok_emb", "pos_emb", "block 0", "block 1", "norm", "head"]
    phases = [("F", unit) for unit in range(len(names))]
    phases += [("B", unit) for unit in reversed(range(len(names)))]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
    for ax, prefetch in zip(axes, (False, True), strict=True):
        for column, (kind, unit) in enumerate(phases):
            ahead = unit + 1 if kind == "F" else unit - 1
            held = {unit: COLORS(0)}
            if prefetch and 0 <= ahead < len(names):
                held[ahead] = COLORS(1)
            for row in range(len(names)):
                ax.add_patch(Rectangle((column, row), 0.9, 0.9, facecolor=held.get(row, "0.93"),
                                       edgecolor="white"))
            ax.text(column + 0.45, len(names) + 0.2, f"{kind}{unit}", ha="center",
                    fontsize=9)
        ax.set_xlim(0, len(phases))
        ax.set_ylim(len(names) + 0.8, 0)
        ax.set_xticks([])
        ax.set_yticks([row + 0.45 for row in range(len(names))], names)
        ax.tick_params(left=False)
        ax.spines[["left", "bottom"]].set_visible(False)
        ax.set_title(f"{'with' if prefetch else 'without'} prefetch: at most "
                     f"{2 if prefetch else 1} unit{'s' if prefetch else ''} gathered")
    fig.suptitle("blue: the unit that runs, gathered   orange: the next one, prefetched   "
                 "(TinyGPT's 6 units; F = forward, B = backward, in time order)",
                 fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    return fig


# --- Lab 05: tensor parallel -------------------------------------------------------------------


def linear_splits() -> Figure:
    return draw_linear_splits(tp=2)


def tensor_parallel_mlp() -> Figure:
    return draw_tensor_parallel_mlp()


def sequence_parallel_mlp() -> Figure:
    return draw_tensor_parallel_mlp(sequence_parallel=True)


def tensor_parallel_activations() -> Figure:
    """Activations of one 7B layer per rank against t under tensor parallelism alone, with
    and without selective recompute (Korthikanti Table 2), and the part TP never splits."""
    model = MODELS["7B"]
    s, h, a = model.seq_len, model.hidden, model.heads
    ts = [1, 2, 4, 8, 16]
    fig, ax = plt.subplots(figsize=(10, 3.9))
    for label, recompute, style in (("TP alone", None, "o-"),
                                    ("TP alone, selective recompute", "selective", "o--")):
        ax.plot(ts, [memory.activation_bytes(s, 1, h, a, tp=t, recompute=recompute) / GB
                     for t in ts], style, color=COLORS(0), lw=2.5, label=label)
    ax.axhline(10 * s * h / GB, color="0.4", ls=":", label="what TP alone never splits")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.set_xlabel("tensor-parallel degree t")
    ax.set_ylabel("GB per layer per rank")
    ax.set_yticks([0.2, 0.5, 1, 2, 3], ["0.2", "0.5", "1", "2", "3"])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(f"One 7B layer's activations per rank (s = {s}, b = 1, a = {a}, 16-bit)")
    ax.legend(fontsize=10, loc="upper right")
    fig.tight_layout()
    return fig


def tensor_parallel_time_in_and_across_nodes() -> Figure:
    """One layer's 4 all-reduces of b·s·h, inside a node and across nodes (alpha-beta)."""
    model = MODELS["7B"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for span_label, span, ts in (("inside a node (NVLink, 450 GB/s)", 8, [2, 4, 8]),
                                 ("spanning nodes (InfiniBand, 50 GB/s)", 16, [2, 4, 8, 16])):
        alpha, beta = H100.link(span)
        times = []
        for t in ts:
            volume = traffic.tensor_parallel_traffic(model.seq_len, 1, model.hidden, t)
            times.append(sum(c.count * collective_time(c.op, c.nbytes, t, alpha, beta)
                             for c in volume.collectives) * 1e3)
        ax.plot(ts, times, "o-", lw=2.5, label=span_label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([2, 4, 8, 16], ["2", "4", "8", "16"])
    ax.set_xlabel("tensor-parallel degree t (a node holds 8 GPUs)")
    ax.set_ylabel("ms per layer per microbatch")
    ax.set_title("TP's 2 + 2 all-reduces per layer (7B, s = 4096, b = 1, bf16), α-β model")
    ax.legend(fontsize=11)
    fig.tight_layout()
    return fig


# --- Lab 06: pipeline parallel -----------------------------------------------------------------


def _gantt(name: str, p: int, m: int, title: str) -> Figure:
    return gantt.draw(pipeline_simulator.simulate(pipeline.schedule(name, p, m)), title)


def naive_pipeline() -> Figure:
    return _gantt("gpipe", 3, 1, "one batch, no microbatches (p = 3)")


def gpipe_only() -> Figure:
    return _gantt("gpipe", 4, 8, "GPipe, p = 4, m = 8")


def interleaved_chunks(p: int = 4, v: int = 2) -> Figure:
    """Which stages each rank holds with v chunks per rank (stage c·p + r on rank r), and the
    path of one microbatch's forward through them."""
    fig, ax = _canvas(11, 3.2, (-1.6, p * v * 1.3 + 0.2), (-0.9, p + 0.5))
    for rank in range(p):
        y = p - 1 - rank
        ax.text(-0.2, y + 0.35, f"rank {rank}", ha="right", va="center", fontsize=11)
        for chunk in range(v):
            stage = chunk * p + rank
            shade = matplotlib.colors.to_hex(COLORS(chunk)) + ("99" if chunk == 0 else "55")
            _box(ax, stage * 1.3, y, 1.1, 0.7, f"stage {stage}", shade, size=10)
    for stage in range(p * v - 1):
        here, there = stage % p, (stage + 1) % p
        _arrow(ax, (stage * 1.3 + 1.1, p - 1 - here + 0.35),
               (stage * 1.3 + 1.3, p - 1 - there + 0.35))
    ax.text(0, -0.7, f"p = {p} ranks, v = {v} chunks each: rank r holds stages r, r + p, …; "
            "arrows: one microbatch's forward", fontsize=11)
    return fig


def backward_split() -> Figure:
    """One stage's backward of one microbatch, split into B (the input's gradient, which the
    stage before waits for) and W (the weights' gradient, needed only at the step)."""
    fig, ax = _canvas(11, 2.4, (-0.2, 12.2), (-0.3, 2.2))
    _box(ax, 0.0, 1.2, 1.6, 0.8, "F", "#cfe3f3")
    _box(ax, 2.2, 1.2, 2.4, 0.8, "backward (B and W)", "#d9cdea", size=11)
    ax.text(5.0, 1.6, "as one action (1F1B)", va="center", fontsize=11)
    _box(ax, 0.0, 0.0, 1.6, 0.8, "F", "#cfe3f3")
    _box(ax, 2.2, 0.0, 1.2, 0.8, "B", "#d9cdea")
    _box(ax, 8.2, 0.0, 1.2, 0.8, "W", "#efe6f7")
    _arrow(ax, (3.4, 0.4), (4.4, 0.4))
    ax.text(4.5, 0.4, "input's gradient → the stage before", va="center", fontsize=10)
    ax.text(9.6, 0.4, "weights' gradient:\nany time before the step", va="center", fontsize=10)
    return fig


# --- Lab 07: 3D parallel and experts -----------------------------------------------------------

def mesh_groups_8() -> Figure:
    return draw_mesh_groups({"pp": 2, "dp": 2, "tp": 2})


def mesh_on_nodes() -> Figure:
    """Where one TP group of 8 lands on 4 nodes of 8 GPUs, with TP fastest or slowest (not
    Lab 07's Q2 layout, whose answer the lab asks for)."""
    gpus, nodes_in_all = 32, 4
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.4))
    orders = (("TP fastest (Megatron): {pp: 2, dp: 2, tp: 8}", {"pp": 2, "dp": 2, "tp": 8}),
              ("TP slowest: {tp: 8, dp: 2, pp: 2}", {"tp": 8, "dp": 2, "pp": 2}))
    for ax, (title, shape) in zip(axes, orders, strict=True):
        group = group_ranks(shape, "tp")[0]
        ax.set_xlim(-0.2, gpus + (nodes_in_all - 1) * 0.6)
        ax.set_ylim(-0.1, 1.3)
        ax.axis("off")
        for gpu in range(gpus):
            node = gpu // 8
            color = "tab:red" if gpu in group else "0.88"
            ax.add_patch(Rectangle((gpu + node * 0.6, 0.1), 0.9, 0.8, facecolor=color,
                                   edgecolor="0.5", lw=0.6))
        for node in range(nodes_in_all):
            ax.text(node * 8.6 + 4, 1.05, f"node {node}", ha="center", fontsize=10)
        nodes = len({gpu // 8 for gpu in group})
        ax.set_title(f"{title}: the TP group of rank 0 spans {nodes} node"
                     + ("s" if nodes > 1 else ""), fontsize=12)
    fig.tight_layout()
    return fig


def bytes_per_dimension_7b() -> Figure:
    """Bytes one rank's collectives carry per step, per mesh dimension: 7B, tp 8, pp 4, bf16."""
    model, tp_size, pp_size, m = MODELS["7B"], 8, 4, 16
    s, h, blocks = model.seq_len, model.hidden, model.layers // pp_size
    layer = traffic.tensor_parallel_traffic(s, 1, h, tp_size)
    sends = traffic.pipeline_traffic(s, 1, h, m)
    gradients = traffic.data_parallel_traffic(model.num_params / (tp_size * pp_size), 8)
    values = {
        "TP":
            blocks * m * sum(c.count * c.nbytes for c in layer.collectives),
        "PP (a middle stage)":
            sum(c.count * c.nbytes for c in sends.collectives),
        "DP":
            sum(c.count * c.nbytes for c in gradients.collectives),
    }
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for k, value in enumerate(values.values()):
        ax.barh(k, value / GB, color=COLORS(k))
        ax.text(value / GB + 0.2, k, f"{value / GB:.2f} GB", va="center", fontsize=11)
    ax.set_yticks(range(len(values)), list(values))
    ax.invert_yaxis()
    ax.set_xlim(0, 21)
    ax.set_xlabel("GB of full tensors per rank per step")
    ax.set_title(f"7B, s = {s}, b = 1, m = {m}, bf16, tp = {tp_size}, pp = {pp_size}: "
                 "TP moves the most")
    fig.tight_layout()
    return fig


def moe_capacity() -> Figure:
    """A modelled router's load on 8 experts against the capacity per capacity factor."""
    experts, tokens, top_k = 8, 4096, 2
    preference = [1.0 / (e + 2) for e in range(experts)]  # a router that favours low experts
    load = [tokens * top_k * p / sum(preference) for p in preference]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ax.bar(range(experts), load, color="0.7")
    for k, factor in enumerate((1.0, 1.25, 2.0)):
        capacity = moe.capacity_of(tokens, top_k, experts, factor)
        dropped = sum(max(0.0, n - capacity) for n in load)
        ax.axhline(capacity, color=COLORS(k + 1), lw=2, linestyle="--",
                   label=f"capacity factor {factor}: {capacity:.0f} per expert, "
                         f"{dropped / (tokens * top_k):.0%} of assignments dropped")
    ax.set_xlabel("expert")
    ax.set_ylabel("tokens routed to it")
    ax.set_ylim(0, 3300)
    ax.set_title(f"{tokens} tokens, top-{top_k}, {experts} experts: capacity = factor · "
                 "tokens · k / E")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig
def parameter_server_time_against_n() -> Figure:
    """α-β step time of a synchronous parameter server against ring all-reduce, 100 MB."""
    fig, ax = plt.subplots(figsize=(10, 4))
    ns, size = [2, 4, 8, 16, 32, 64, 128], 100e6
    for servers in (1, 8, 64):
        ax.plot(ns, [parameter_server_time(size, n, servers, ALPHA, 1 / BANDWIDTH) * 1e3
                     for n in ns], "o-", lw=2, label=f"parameter server, {servers} server(s)")
    ax.plot(ns, [all_reduce_time("ring", size, n, ALPHA, 1 / BANDWIDTH) * 1e3 for n in ns],
            "o-", lw=2.5, color="black", label="ring all-reduce")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("predicted ms per step")
    ax.set_title(f"100 MB of gradients, α = {ALPHA * 1e6:.0f} µs, "
                 f"1/β = {BANDWIDTH / 1e9:.0f} GB/s")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig


def moe_dispatch() -> Figure:
    """Expert parallel on 2 ranks: route, all-to-all to the experts, run them, all-to-all back."""
    fig, ax = _canvas(12, 3.8, (0, 12), (0, 4))
    steps = [("tokens of rank r,\nsorted by expert", "#fde9b6"),
             ("counts → split\nsizes (an all-to-all\nof the counts)", "0.92"),
             ("all-to-all:\ntokens to their\nexpert's rank", "#cfe3f3"),
             ("local experts\nrun their tokens", "#d5ecd4"),
             ("all-to-all back,\nundo the sort", "#cfe3f3")]
    for k, (text, color) in enumerate(steps):
        _box(ax, 0.2 + k * 2.4, 1.4, 2.0, 1.3, text, color, size=11)
        if k:
            _arrow(ax, (0.2 + k * 2.4 - 0.38, 2.05), (0.2 + k * 2.4 - 0.02, 2.05))
    ax.text(6, 0.6, "a token goes to its expert's rank and comes back",
            ha="center", fontsize=12)
    ax.text(6, 3.35, "each rank holds E / ep experts; split sizes are known only at run time",
            ha="center", fontsize=12)
    return fig
def staleness_convergence() -> Figure:
    """Gradient descent with gradients τ updates old (param_server.stale_gradient_descent)."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for tau in (0, 1, 2, 4, 8):
        ax.plot(stale_gradient_descent([1.0, 0.3, 0.1], 0.3, tau, 60), lw=2, label=f"τ = {tau}")
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("loss")
    ax.set_title("½Σcᵢxᵢ², c = 1, 0.3, 0.1, η = 0.3: staleness shrinks the stable step size")
    ax.legend(fontsize=10, loc="lower left")
    fig.tight_layout()
    return fig


def compressed_bytes_against_n() -> Figure:
    """Bytes each rank sends per step for one 4096 × 4096 fp32 gradient, per compression."""
    fig, ax = plt.subplots(figsize=(10, 4))
    ns, n = list(range(2, 65)), 4096
    numel, rank, k = n * n, 4, n * n // 100
    lines = {
        "ring all-reduce, fp32": [ring_bytes_sent("all_reduce", 4 * numel, w) for w in ns],
        "int8 (all-to-all + all-gather)": [ring_bytes_sent("all_reduce", numel, w) for w in ns],
        "top-k 1%: (N−1)·k values + indices": [(w - 1) * k * 8 for w in ns],
        "PowerSGD r = 4: (n+m)·r, all-reduced": [
            ring_bytes_sent("all_reduce", 4 * 2 * n * rank, w) for w in ns],
    }
    for label, values in lines.items():
        ax.plot(ns, [v / 2**20 for v in values], lw=2.5, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MiB sent per rank per step")
    ax.set_title("One 4096 × 4096 gradient (64 MiB): top-k's all-gather grows with N")
    ax.legend(fontsize=10, loc="center right")
    fig.tight_layout()
    return fig


def async_tp_timeline(t: int = 3) -> Figure:
    """All-gather then matmul, against ring steps whose matmuls overlap the next transfer
    (a shard's transfer and matmul take one unit each)."""
    plain_done, async_done = 2 * t - 1, t
    fig, ax = _canvas(10, 3.2, (-2.4, plain_done + 1.6), (0.2, 4.1))
    rows = {"plain: link": 3.3, "plain: compute": 2.5, "async: link": 1.2, "async: compute": 0.4}
    for label, y in rows.items():
        ax.text(-0.15, y + 0.3, label, ha="right", va="center", fontsize=11)
    for hop in range(t - 1):
        _box(ax, hop, rows["plain: link"], 1, 0.6, f"gather {hop + 1}", "#f4b183", size=10)
        _box(ax, hop, rows["async: link"], 1, 0.6, f"shard {hop + 1}", "#f4b183", size=10)
    for k in range(t):
        _box(ax, t - 1 + k, rows["plain: compute"], 1, 0.6, f"matmul {k}", "#9dc3e6",
             size=10)
        _box(ax, k, rows["async: compute"], 1, 0.6, f"matmul {k}", "#9dc3e6", size=10)
    for done, name in ((async_done, "async"), (plain_done, "plain")):
        ax.axvline(done, color="0.4", ls="--", lw=1)
        ax.text(done + 0.05, 2.0, f"{name} done: {done}", fontsize=11)
    ax.text(0, 4.0, f"t = {t} ranks; one rank's view", fontsize=11)
    return fig


def _wasted_fraction(interval: float, write_time: float, mtbf: float) -> float:
    """Young's model: time writing checkpoints plus work lost to failures, per unit of time."""
    return write_time / interval + interval / (2 * mtbf)


def checkpoint_waste_against_interval() -> Figure:
    """δ/τ + τ/2M against τ, minimum at Young's √(2δM), for δ = 2 min and three MTBFs."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    write_time = 2.0
    intervals = [5 + i * 0.5 for i in range(391)]
    for color, hours in enumerate((3, 12, 48)):
        mtbf = 60.0 * hours
        ax.plot(intervals, [100 * _wasted_fraction(t, write_time, mtbf) for t in intervals],
                color=COLORS(color), label=f"M = {hours} h")
        best = (2 * write_time * mtbf) ** 0.5
        ax.plot([best], [100 * _wasted_fraction(best, write_time, mtbf)], "o", color=COLORS(color))
        ax.annotate(f"τ* = {best:.0f} min", (best, 100 * _wasted_fraction(best, write_time, mtbf)),
                    textcoords="offset points", xytext=(4, -16), fontsize=10, color=COLORS(color))
    ax.set_xlabel("checkpoint interval τ (minutes)")
    ax.set_ylabel("% of run time wasted")
    ax.set_ylim(0, 40)
    ax.set_title("δ = 2 min per checkpoint: waste δ/τ + τ/2M against τ")
    ax.legend(fontsize=11)
    fig.tight_layout()
    return fig


def resharding_overlaps() -> Figure:
    """A flat tensor of 10 elements saved by 4 ranks and loaded by 2 (and 3): each new rank
    reads the overlapping pieces of the old files (comm.chunk_bounds)."""
    numel = 10
    fig, ax = _canvas(10, 3.6, (-2.2, numel + 0.3), (-0.4, 3.4))
    rows = ((4, "saved on 4", 2.6), (2, "loaded on 2", 1.4), (3, "loaded on 3", 0.2))
    for world_size, label, y in rows:
        ax.text(-0.2, y + 0.35, label, ha="right", va="center", fontsize=11)
        for rank, (start, end) in enumerate(chunk_bounds(numel, world_size)):
            _box(ax, start, y, end - start, 0.7, f"rank {rank}\n[{start}, {end})",
                 color=matplotlib.colors.to_hex(COLORS(rank), keep_alpha=False) + "55")
    for start, _ in chunk_bounds(numel, 4)[1:]:
        ax.plot([start, start], [0.2, 3.3], color="0.3", lw=0.8, ls=":")
    ax.set_title("Resharding: new rank r reads [its range] ∩ [each old piece], nothing else",
                 loc="left", fontsize=12)
    return fig


def lost_work_timeline() -> Figure:
    """Checkpoints every τ; a failure loses the work since the last complete one, plus the
    restart."""
    fig, ax = _canvas(10, 2.8, (-0.2, 10.4), (-0.9, 1.9))
    interval, write, failure, restart = 2.5, 0.35, 6.6, 0.8
    t = 0.0
    while t + interval <= failure:
        _box(ax, t, 0.6, interval - write, 0.6, "train", color="#d8e8f6")
        _box(ax, t + interval - write, 0.6, write, 0.6, "", color="#f2c14e")
        t += interval
    _box(ax, t, 0.6, failure - t, 0.6, "lost", color="#f4b6b6")
    ax.text(failure, 1.45, "× failure", ha="center", color="#b22222", fontsize=12)
    _box(ax, failure, 0.6, restart, 0.6, "restart", color="0.85", size=10)
    _box(ax, failure + restart, 0.6, failure - t, 0.6, "redo", color="#f4b6b6")
    _box(ax, failure + restart + failure - t, 0.6, 10.2 - (2 * failure + restart - t), 0.6,
         "train", color="#d8e8f6")
    ax.annotate("", (failure, 0.3), (t, 0.3), arrowprops={"arrowstyle": "<->"})
    ax.text((t + failure) / 2, -0.1, "work since the last complete checkpoint",
            ha="center", fontsize=11)
    ax.text(0, 1.45, "yellow: checkpoint writes (δ each)", fontsize=11)
    return fig


def async_checkpoint_timeline() -> Figure:
    """A blocking save stops training for staging and the write; async_save stops it only for
    staging, the write overlapping the next steps."""
    fig, ax = _canvas(10, 3.0, (-2.0, 10.4), (-0.2, 2.6))
    step, stage, write = 1.2, 0.8, 2.6
    for label, y, blocking in (("save", 1.5, True), ("async_save", 0.3, False)):
        ax.text(-0.2, y + 0.3, label, ha="right", va="center", fontsize=11)
        for start in (0.0, step):  # two training steps
            _box(ax, start, y, step, 0.6, "step", color="#d8e8f6")
        t = 2 * step
        _box(ax, t, y, stage, 0.6, "stage", color="#f2c14e", size=10)
        t += stage
        if blocking:
            _box(ax, t, y, write, 0.6, "write", color="#f4b6b6")
            t += write
        else:
            _box(ax, t, y - 0.25, write, 0.2, "", color="#f4b6b6")
            ax.text(t + write / 2, y - 0.42, "write, in the background", ha="center", fontsize=10)
        while t + step <= 10.2:
            _box(ax, t, y, step, 0.6, "step", color="#d8e8f6")
            t += step
    return fig


def _modelled_timeline(communication: list[tuple[float, float]], compute_end: float,
                       ranks: int = 2, slow: dict[int, float] | None = None) -> ProfileTimeline:
    """A ProfileTimeline of the modelled backward above (seconds): every rank computes until
    `compute_end` (plus `slow[rank]`), and communicates over `communication`, each span
    starting no earlier than the slowest rank is ready for it."""
    slow = slow or {}
    late = max(slow.values(), default=0.0)
    events = []
    for rank in range(ranks):
        events.append(Event(rank, "compute", "backward", 0.0, compute_end + slow.get(rank, 0.0),
                            1))
        events += [Event(rank, "communication", "all_reduce", start + late, end + late, 2)
                   for start, end in communication]
    end = max(e.end for e in events)
    return ProfileTimeline(ranks, events, {rank: [(0.0, end)] for rank in range(ranks)})


def profiled_flat_and_buckets() -> Figure:
    """ProfileTimeline.plot of the modelled backward: one flat buffer against 50 MB buckets."""
    end = _end_of_backward()
    flat = [(end, end + _all_reduce_time(sum(nbytes for _, nbytes in _tensors())))]
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.6))
    _modelled_timeline(flat, end).plot("one flat buffer (modelled)", ax=axes[0])
    _modelled_timeline(_bucketed_spans(50e6), end).plot("50 MB buckets (modelled)", ax=axes[1])
    right = max(ax.get_xlim()[1] for ax in axes)
    for ax in axes:
        ax.set_xlim(0, right)
        ax.set_xlabel("ms")
    fig.tight_layout()
    return fig


def straggler_timeline() -> Figure:
    """Four ranks' backward, rank 2's 6 ms longer; each rank's step drawn up to the end of its
    own backward, so that what the all-reduce then does to the others is left to Lab 08's Q6."""
    end, slow = _end_of_backward(), {2: 6e-3}
    events = [Event(rank, "compute", "backward", 0.0, end + slow.get(rank, 0.0), 1)
              for rank in range(4)]
    steps = {rank: [(0.0, end + slow.get(rank, 0.0))] for rank in range(4)}
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ProfileTimeline(4, events, steps).plot(
        "rank 2 computes 6 ms longer (modelled), before the all-reduce", ax=ax)
    ax.set_xlabel("ms")
    fig.tight_layout()
    return fig


def mfu_and_hfu_by_recompute() -> Figure:
    """FLOPs per token counted by MFU and by HFU, for a 7B model, by recompute setting."""
    model = MODELS["7B"]
    shape = (model.num_params, model.layers, model.hidden, model.seq_len)
    settings = [None, "selective", "full"]
    model_flops = flops.model_flops_per_token(*shape)
    hardware = [flops.hardware_flops_per_token(*shape, recompute=r) for r in settings]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    x = range(len(settings))
    ax.bar(x, [h / 1e9 for h in hardware], color=COLORS(1), label="HFU counts (hardware ran)")
    ax.bar(x, [model_flops / 1e9] * 3, color=COLORS(0), label="MFU counts: 6Ψ + 12·L·h·s")
    for i, h in enumerate(hardware):
        ax.text(i, h / 1e9 + 1, f"HFU/MFU = {h / model_flops:.2f}", ha="center", fontsize=11)
    ax.set_xticks(list(x), ["no recompute", "selective", "full recompute"])
    ax.set_ylabel("GFLOPs per token")
    ax.set_ylim(0, max(hardware) / 1e9 * 1.2)
    ax.set_title("7B (Llama 2 shape), s = 4096: the same step, two utilisations")
    ax.legend(fontsize=10, loc="lower right")
    fig.tight_layout()
    return fig


SCALING_COMPUTE_S = 0.5  # one rank's step on its batch (modelled)


def scaling_efficiency() -> Figure:
    """Predicted strong and weak scaling efficiency of data parallel, 1 GB of gradients."""
    ns = [1, 2, 4, 8, 16, 32, 64]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for bandwidth, style in ((25e9, "-"), (200e9, "--")):
        all_reduce = {n: collective_time("all_reduce", 1e9, n, DP_ALPHA, 1 / bandwidth)
                      if n > 1 else 0.0 for n in ns}
        strong = [flops.strong_scaling_efficiency(SCALING_COMPUTE_S,
                                                  SCALING_COMPUTE_S / n + all_reduce[n], n)
                  for n in ns]
        weak = [flops.weak_scaling_efficiency(SCALING_COMPUTE_S, SCALING_COMPUTE_S + all_reduce[n])
                for n in ns]
        ax.plot(ns, strong, style, color=COLORS(0), lw=2.5,
                label=f"strong, {bandwidth / 1e9:.0f} GB/s")
        ax.plot(ns, weak, style, color=COLORS(1), lw=2.5, label=f"weak, {bandwidth / 1e9:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("efficiency")
    ax.set_title("0.5 s of compute, 1 GB of gradients, nothing overlapped (α-β model)")
    ax.legend(fontsize=10, ncol=2)
    fig.tight_layout()
    return fig


# --- Lab 12: memory beyond the GPU ---------------------------------------------------------------

# Assumptions the slides state: a multi-threaded CPU Adam's parameters/s; NVMe read, write B/s
OFFLOAD_CPU_RATE = 2e9
OFFLOAD_DISK = (3e9, 2e9)
# The deck's offload scenario: 7B (Llama 2's shape) fine-tuned on one H100, 8 sequences of 4,096
# tokens a step at 40% of 989 TFLOP/s (Lab 12's); 16Ψ does not fit its 80 GB without offload
OFFLOAD_PSI = 6.7e9
OFFLOAD_COMPUTE = 3.33


def tiers_bytes() -> Figure:
    """Where each byte of a 7B model's training state lives when it is fine-tuned on one 80 GB
    GPU, for each offload tier (minidist.costs.tiers): without offload it does not fit."""
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = {None: "no offload", "host": "offload to host", "nvme": "offload to NVMe"}
    for i, tier in enumerate(tiers.OFFLOAD):
        state = tiers.model_state_by_tier(OFFLOAD_PSI, 2, 1, tier)
        for j, part in enumerate(("device", "host", "nvme")):
            value = getattr(state, part) / GB
            ax.bar(i * 4 + j, value, color=COLORS(j), label=part if i == 0 else None)
            if value:
                ax.text(i * 4 + j, value, f"{value:.1f}", ha="center", va="bottom", fontsize=10)
    ax.axhline(80, color="0.3", linestyle="--", linewidth=1)
    ax.text(2, 82, "one GPU: 80 GB", ha="center", va="bottom", fontsize=10, color="0.3")
    ax.set_xticks([i * 4 + 1 for i in range(3)], [labels[t] for t in tiers.OFFLOAD])
    ax.set_ylabel("GB")
    ax.set_ylim(0, 125)
    ax.set_title("7B (Ψ = 6.7e9), mixed-precision Adam, on one GPU: what each tier holds")
    ax.legend(title="tier", fontsize=10, loc="upper right")
    fig.tight_layout()
    return fig


def offload_transfer_timeline() -> Figure:
    """One offloaded step, schematic (not to scale): each layer's gradient slice leaves for the
    host as backward produces it, the CPU steps, the parameters come back; the durations for
    7B on one H100 are written beside each lane (minidist.costs.tiers)."""
    psi, n, compute = OFFLOAD_PSI, 1, OFFLOAD_COMPUTE
    moved = tiers.offload_transfer_bytes(psi, n)
    pcie = tiers.PCIE_BANDWIDTH["gen5"]
    fig, ax = _canvas(15, 3.8, (-2.6, 24), (0, 4.3))
    lanes = {"GPU": 3.3, "PCIe → host": 2.35, "CPU": 1.4, "PCIe → GPU": 0.45}
    for name, y in lanes.items():
        ax.text(-0.15, y + 0.3, name, ha="right", va="center", fontsize=11)
    _box(ax, 0, lanes["GPU"], 3, 0.6, "forward", "#9dc3e6", size=10)
    ax.text(6, lanes["GPU"] + 0.85, "backward, layer by layer", ha="center", fontsize=10)
    layers = 6
    for k in range(layers):  # backward runs the layers last to first
        _box(ax, 3 + k, lanes["GPU"], 1, 0.6, f"L{layers - k}", "#9dc3e6", size=9)
        _box(ax, 4 + k, lanes["PCIe → host"], 0.6, 0.6, "", "#f4b183")
    _box(ax, 9.6, lanes["CPU"], 4, 0.6, "AdamW, Ψ params", "#a9d18e", size=10)
    _box(ax, 13.6, lanes["PCIe → GPU"], 0.8, 0.6, "", "#f4b183")
    _box(ax, 14.4, lanes["GPU"], 2.6, 0.6, "next forward", "#dbe9f6", size=10)
    notes = {"PCIe → host": f"2Ψ = {moved.to_host / GB:.1f} GB: "
                            f"{moved.to_host / pcie:.2f} s, under backward",
             "CPU": f"{psi / n / 1e9:.1f} G parameters at the CPU's rate",
             "PCIe → GPU": f"2Ψ back: {moved.to_device / pcie:.2f} s"}
    for lane, text in notes.items():
        ax.text(17.3, lanes[lane] + 0.3, text, ha="left", va="center", fontsize=10,
                color="0.25")
    ax.set_title(f"ZeRO-Offload step, schematic; 7B on one H100 (PCIe Gen5, 64 GB/s): compute "
                 f"{compute} s", fontsize=11)
    return fig


def offload_step_time() -> Figure:
    """The time model's parts for 7B fine-tuned on one H100: host and NVMe; without offload the
    state does not fit, and the figure says so beside them."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    parts = ("compute", "to_host", "optimizer", "disk", "to_device")
    rows = {"host": tiers.offload_step_time(OFFLOAD_PSI, 1, OFFLOAD_COMPUTE, "host", 64e9,
                                            OFFLOAD_CPU_RATE),
            "NVMe": tiers.offload_step_time(OFFLOAD_PSI, 1, OFFLOAD_COMPUTE, "nvme", 64e9,
                                            OFFLOAD_CPU_RATE, *OFFLOAD_DISK)}
    state = tiers.model_state_by_tier(OFFLOAD_PSI, 2, 1).device / GB
    ax.text(1.5, 0, f"does not fit: {state:.0f} GB of model state > 80 GB", va="center",
            color="0.3")
    for i, time in enumerate(rows.values(), start=1):
        left = 0.0
        for j, part in enumerate(parts):
            value = getattr(time, part)
            ax.barh(i, value, left=left, color=COLORS(j), label=part if i == 1 else None)
            left += value
        ax.text(left, i, f" {left:.1f} s", va="center")
    ax.set_yticks(range(len(rows) + 1), ["no offload", *rows])
    ax.set_ylim(len(rows) + 0.6, -0.6)  # top to bottom, room for the row without a bar
    ax.set_xlabel("seconds per step")
    ax.set_title("7B on one H100: what offload costs (CPU Adam 2 G param/s, NVMe read 3 GB/s, "
                 "write 2 GB/s: assumed)", fontsize=11)
    ax.legend(fontsize=9, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    return fig


def fsdp1_fsdp2_map() -> Figure:
    """FSDP1's options, each with its FSDP2 equivalent."""
    rows = [("ShardingStrategy.FULL_SHARD", "fully_shard(..., reshard_after_forward=True)"),
            ("ShardingStrategy.SHARD_GRAD_OP", "fully_shard(..., reshard_after_forward=False)"),
            ("ShardingStrategy.NO_SHARD", "DistributedDataParallel"),
            ("ShardingStrategy.HYBRID_SHARD", "fully_shard(..., mesh=2-D (replicate, shard))"),
            ("auto_wrap_policy=ModuleWrapPolicy({Block})", "fully_shard(block) each, then root"),
            ("backward_prefetch=BACKWARD_PRE", "prefetching by default"),
            ("mixed_precision=MixedPrecision(...)", "mp_policy=MixedPrecisionPolicy(...)"),
            ("cpu_offload=CPUOffload(offload_params=True)", "offload_policy=CPUOffloadPolicy()")]
    fig, ax = _canvas(12, 4.8, (0, 12), (-0.6, len(rows) + 0.9))
    ax.text(2.7, len(rows) + 0.4, "FSDP1: FullyShardedDataParallel(model, ...)", ha="center",
            fontsize=12, weight="bold")
    ax.text(9.3, len(rows) + 0.4, "FSDP2: fully_shard", ha="center", fontsize=12, weight="bold")
    for i, (one, two) in enumerate(rows):
        y = len(rows) - 1 - i
        on_cpu = "CPUOffload" not in one
        _box(ax, 0, y + 0.1, 5.4, 0.75, one, "#dbe9f6", size=10, family="monospace")
        _box(ax, 6.6, y + 0.1, 5.4, 0.75, two, "#e2f0d9" if on_cpu else "#fbe5d6", size=10,
             family="monospace")
        _arrow(ax, (5.45, y + 0.47), (6.55, y + 0.47), style="<|-|>")
    ax.text(0, -0.35, "orange: needs a GPU (torch 2.13 on CPU raises); the rest run on CPU with "
            "gloo", fontsize=10, color="0.3")
    return fig


def held_after_forward() -> Figure:
    """Parameter bytes a rank holds between forward and backward, per FSDP1 strategy, for a
    7B-like model of 32 blocks in bf16 on 8 GPUs (2 nodes of 4 for HYBRID_SHARD)."""
    blocks, root = [6.4e9 / 32] * 32, 0.3e9
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for i, name in enumerate(fsdp1.STRATEGIES):
        held = fsdp1.parameter_bytes_after_forward(name, blocks, root, 8, shard_size=4,
                                                   bytes_per_element=2) / GB
        ax.bar(i, held, color=COLORS(i))
        ax.text(i, held, f"{held:.1f} GB", ha="center", va="bottom")
    ax.set_xticks(range(4), list(fsdp1.STRATEGIES))
    ax.set_ylabel("GB of parameters per rank")
    ax.set_title("Held from the end of forward to the start of backward (6.7B params, bf16, "
                 "N = 8)", fontsize=11)
    fig.tight_layout()
    return fig


def clipping_pieces() -> Figure:
    """Whose squares add up to the global norm on a tp2·pp2 model."""
    fig, ax = _canvas(11, 3.6, (0, 11), (0, 4))
    for stage in range(2):
        for tp in range(2):
            x, y = 0.4 + stage * 5.4, 2.1 - tp * 1.7
            rank = stage * 2 + tp
            _box(ax, x, y, 2.4, 1.2, f"rank {rank}\nsplit weights\n(a 1/t piece)", "#9dc3e6",
                 size=9)
            counted = tp == 0
            _box(ax, x + 2.5, y, 2.2, 1.2,
                 "replicated:\nLayerNorms, biases\n" + ("counted here" if counted else
                                                        "NOT counted"),
                 "#a9d18e" if counted else "#eeeeee", size=9)
        ax.text(0.4 + stage * 5.4 + 2.3, 3.55, f"pipeline stage {stage}", ha="center",
                fontsize=11, weight="bold")
    ax.text(5.5, 0.05, "‖g‖² = the coloured squares summed over every rank: an all-reduce "
            "(SUM) of one number over TP, then over PP", ha="center", fontsize=11)
    return fig


# --- Lab 13: long context ----------------------------------------------------------------------

CP_COLORS = ["#9dc3e6", "#f4b183", "#a9d18e", "#ffd966"]


def long_context_activations() -> Figure:
    """Activations per GPU of a 7B-like model (h = 4096, a = 32, 32 layers) against s."""
    lengths = [2**k for k in range(13, 21)]
    setups = {"TP8 + SP": dict(tp=8, sequence_parallel=True),
              "TP8 + SP + selective recompute": dict(tp=8, sequence_parallel=True,
                                                    recompute="selective"),
              "... + CP16": dict(tp=8, sequence_parallel=True, recompute="selective", cp=16)}
    fig, ax = plt.subplots(figsize=(10, 4))
    for color, (label, setup) in enumerate(setups.items()):
        cp = setup.pop("cp", 1)
        gb = [32 * memory.activation_bytes(s, 1, 4096, 32, **setup) / cp / GB for s in lengths]
        ax.loglog(lengths, gb, "o-", color=COLORS(color), lw=2.5, label=label)
    ax.axhline(80, color="black", ls="--", lw=1.2, label="80 GB GPU")
    ax.set_xticks(lengths, [f"{s // 1024}k" for s in lengths])
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("activations per GPU (GB)")
    ax.set_title("7B-like model, 32 layers, b = 1, 16-bit activations (Korthikanti's formula)")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig


def ring_attention_steps(cp: int = 4) -> Figure:
    """Which key/value block each rank holds at each step of the ring: queries stay, blocks move
    one rank to the right per step."""
    fig, ax = _canvas(10, 3.6, (-2.2, cp * 2.2 + 0.2), (-0.4, cp + 0.9))
    for step in range(cp):
        ax.text(step * 2.2 + 1.0, cp + 0.5, f"step {step}", ha="center", fontsize=12)
        for rank in range(cp):
            y = cp - 1 - rank
            source = (rank - step) % cp
            _box(ax, step * 2.2, y + 0.1, 2.0, 0.75, f"Q{rank} · K{source}V{source}",
                 CP_COLORS[source], size=11)
            if step < cp - 1 and rank < cp - 1:  # the block moves one rank to the right
                _arrow(ax, (step * 2.2 + 2.0, y + 0.47), (step * 2.2 + 2.2, y - 0.53),
                       color="0.45")
    ax.text(cp * 1.1, -0.3, "each step every block moves to the next rank (rank 3's to rank 0); "
            "the queries stay", ha="center", fontsize=11, color="0.3")
    for rank in range(cp):
        ax.text(-0.15, cp - 1 - rank + 0.47, f"rank {rank}", ha="right", va="center", fontsize=12)
    return fig


def online_softmax_merge() -> Figure:
    """One query's softmax over 8 keys: each of two blocks of 4 alone, and over all 8 (what a
    merge of the two must give), with each block's share of the whole normaliser."""
    scores = [1.2, -0.3, 2.1, 0.4, 0.9, 2.6, -1.0, 0.2]
    exps = [2.718281828**x for x in scores]
    total, first, second = sum(exps), sum(exps[:4]), sum(exps[4:])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), sharey=True)
    panels = [("block A alone: softmax over keys 0–3", [e / first for e in exps[:4]] + [0] * 4),
              ("block B alone: softmax over keys 4–7", [0] * 4 + [e / second for e in exps[4:]]),
              ("all 8 keys: what merging A and B gives", [e / total for e in exps])]
    for ax, (title, weights) in zip(axes, panels, strict=True):
        ax.bar(range(8), weights, color=[CP_COLORS[0]] * 4 + [CP_COLORS[1]] * 4,
               edgecolor="0.3")
        ax.set_title(title, fontsize=11)
        ax.set_xticks(range(8))
        ax.set_xlabel("key $j$")
    axes[0].set_ylabel("weight $p_j$")
    shares = rf"share of $\Sigma_j\, e^{{x_j}}$: A {first / total:.2f}, B {second / total:.2f}"
    axes[2].text(0.02, 0.95, shares, transform=axes[2].transAxes, va="top", fontsize=10)
    fig.tight_layout()
    return fig


def zigzag_layout(cp: int = 4) -> Figure:
    """The causal blocks (queries down, keys across, 2·cp chunks) each rank computes, and the
    work per rank, contiguous against zigzag."""
    chunks = 2 * cp
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    work = {}
    for ax, layout in zip(axes[:2], LAYOUTS, strict=True):
        owner = {}
        for rank in range(cp):
            for position in positions(chunks, rank, cp, layout=layout).tolist():
                owner[position] = rank
        counts = [0.0] * cp
        for q in range(chunks):
            for k in range(q + 1):
                share = 0.5 if k == q else 1.0
                counts[owner[q]] += share
                ax.add_patch(Rectangle((k, chunks - 1 - q), 1, 1, facecolor=CP_COLORS[owner[q]],
                                       edgecolor="white", alpha=0.5 + 0.5 * (k < q)))
        work[layout] = counts
        ax.set_xlim(0, chunks)
        ax.set_ylim(0, chunks)
        ax.set_aspect("equal")
        ax.set_xticks([i + 0.5 for i in range(chunks)], range(chunks))
        ax.set_yticks([chunks - 0.5 - i for i in range(chunks)], range(chunks))
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk")
        ax.set_title(f"{layout}: colour = rank", fontsize=12)
    for i, layout in enumerate(LAYOUTS):
        axes[2].bar([r + 0.4 * i for r in range(cp)], work[layout], width=0.4,
                    color=COLORS(i), label=layout)
    axes[2].set_xticks([r + 0.2 for r in range(cp)], [f"rank {r}" for r in range(cp)])
    axes[2].set_ylabel("blocks of (s/2cp)² scored")
    axes[2].set_title(f"causal work per rank, cp = {cp}", fontsize=12)
    axes[2].legend(fontsize=10)
    fig.tight_layout()
    return fig


def ring_against_all_to_all() -> Figure:
    """Bytes per rank (forward + backward) against cp at s/cp fixed, and α-β forward time
    against s on an H100 node's NVLink (cp = 8), ring against Ulysses."""
    from minidist.costs.cost import AlphaBeta

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    cps = [2, 4, 8, 16, 32, 64]
    width, per_rank = 8 * 128, 8192  # a TP rank's 8 heads of 128, 8k tokens per rank
    for color, (name, formula) in enumerate((("ring", traffic.ring_attention_traffic),
                                             ("Ulysses", traffic.ulysses_traffic))):
        left.plot(cps, [formula(per_rank * c, 1, width, c, 2).bytes_sent / GB for c in cps],
                  "o-", color=COLORS(color), lw=2.5, label=name)
    left.set_xscale("log", base=2)
    left.set_xticks(cps, [str(c) for c in cps])
    left.set_xlabel("cp (8k tokens per rank)")
    left.set_ylabel("GB sent per rank, fwd + bwd")
    left.set_title("bytes per rank per attention", fontsize=12)
    left.legend(fontsize=10)
    nvlink, rate = AlphaBeta(alpha=5e-6, beta=1 / 450e9), 0.5 * 989e12
    lengths = [2**k for k in range(10, 19)]
    for color, name in enumerate(("ring", "ulysses")):
        ratios = [forward_times(s, 1, 8, 128, 8, nvlink, rate, 2)[name]
                  / (4 * 8 * s * (s / 8) * 128 / rate) for s in lengths]
        right.loglog(lengths, ratios, "o-", color=COLORS(color), lw=2.5,
                     label="ring" if name == "ring" else "Ulysses")
    right.axhline(1, color="0.4", ls="--", lw=1.2, label="attention alone")
    right.set_xticks(lengths, [f"{s // 1024}k" for s in lengths])
    right.set_xlabel("sequence length s (cp = 8, 8 heads of 128, bf16)")
    right.set_ylabel("forward time / attention's own")
    right.set_title("α-β model: H100 NVLink, attention at 50% of peak", fontsize=12)
    right.legend(fontsize=10)
    fig.tight_layout()
    return fig


# --- Lab 11: nodes and links -------------------------------------------------------------------

LAB_NETWORK = TwoTier(ranks_per_node=2)  # Lab 11's emulated network (laptop scale)


def two_tier_network() -> Figure:
    """Lab 11's emulated network: 2 nodes of 2 ranks, fast links inside, slow between."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    draw_two_tiers(LAB_NETWORK, 4, ax=ax)
    ax.set_title("Lab 11's network: 2 nodes x 2 ranks, intra-node links 10x the inter-node ones",
                 fontsize=12)
    return fig


def hierarchical_phases() -> Figure:
    """Hierarchical all-reduce on 2 nodes of 2: what each rank holds after each phase."""
    phases = [
        ("start", [[f"{c}{r}" for c in "ab"] for r in range(4)]),
        ("1. reduce-scatter\ninside each node", [["Σ₀a", ""], ["", "Σ₀b"], ["Σ₁a", ""],
                                                    ["", "Σ₁b"]]),
        ("2. all-reduce of the\nshard across nodes", [["Σa", ""], ["", "Σb"], ["Σa", ""],
                                                       ["", "Σb"]]),
        ("3. all-gather\ninside each node", [["Σa", "Σb"]] * 4),
    ]
    fig, ax = _canvas(12, 3.6, (-1.3, 4 * 3.1), (-0.6, 4.9))
    for column, (title, held) in enumerate(phases):
        x = column * 3.1
        ax.text(x + 1.0, 4.45, title, ha="center", va="center", fontsize=11)
        for rank, boxes in enumerate(held):
            y = 3.3 - rank - (0.3 if rank >= 2 else 0)
            if column == 0:
                ax.text(-0.2, y + 0.35, f"rank {rank} (node {rank // 2})", ha="right",
                        va="center", fontsize=10)
            for i, text in enumerate(boxes):
                color = COLORS(i) if text else "white"
                ax.add_patch(Rectangle((x + i * 1.0, y), 0.95, 0.7, facecolor=color,
                                       alpha=0.75 if text.startswith("Σ") else 0.3,
                                       edgecolor="0.4"))
                ax.text(x + i * 1.0 + 0.475, y + 0.35, text, ha="center", va="center",
                        fontsize=10)
        if column:
            _arrow(ax, (x - 0.95, 1.9), (x - 0.2, 1.9))
    ax.text(0, -0.45, "Σ₀a: chunk a summed over node 0; Σa: over every rank. Phases 1 and 3 use "
            "the fast links; only phase 2 crosses nodes, with half the tensor per rank.",
            fontsize=10)
    return fig


def inter_node_bytes() -> Figure:
    """Bytes through the busiest inter-node port per byte of tensor: the flat ring on one
    channel and on g channels (NCCL's, a channel per NIC) against hierarchical, for n nodes of
    g = 8 GPUs."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    nodes = [2, 4, 8, 16, 32, 64]
    g = 8
    flat = [ring_bytes_sent("all_reduce", 1.0, n * g) for n in nodes]
    hierarchical = [hierarchical_bytes(1.0, n, g)["inter"] for n in nodes]
    ax.plot(nodes, flat, "o-", lw=2.5, label="flat ring, 1 channel: 2(ng-1)/(ng) · S through one "
            "GPU's port")
    ax.plot(nodes, [bytes_ / g for bytes_ in flat], "o--", lw=2.5,
            label="flat ring, g channels (NCCL): 2(ng-1)/(ng) · S/g through every port")
    ax.plot(nodes, hierarchical, "o-", lw=2.5, label="hierarchical: 2(n-1)/n · S/g")
    ax.set_xscale("log", base=2)
    ax.set_xticks(nodes, [str(n) for n in nodes])
    ax.set_ylim(0, 2.2)
    ax.set_xlabel("nodes n (8 GPUs each)")
    ax.set_ylabel("bytes between nodes / S")
    ax.set_title("Through the busiest inter-node port, in one all-reduce of S bytes")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig


def two_tier_time_against_size() -> Figure:
    """All-reduce time per algorithm on Lab 11's two-tier network, from its alpha-beta model,
    and what auto picks."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    sizes = [2.0**k for k in range(10, 27)]
    for algorithm in algorithms.names("all_reduce"):
        ax.loglog(sizes, [LAB_NETWORK.all_reduce_time(algorithm, s, 4) * 1e3 for s in sizes],
                  lw=2.5 if algorithm in ("ring", "hierarchical") else 1.5, label=algorithm)
    ax.loglog(sizes, [LAB_NETWORK.all_reduce_time("ring", s, 4, channels=2) * 1e3 for s in sizes],
              "--", lw=2.5, color="0.4", label="ring on 2 channels (NCCL-like; not among auto's)")
    crossover = next(s for s in sizes if LAB_NETWORK.best_all_reduce(s, 4) == "hierarchical")
    ax.axvline(crossover, color="0.5", ls="--", lw=1)
    ax.text(crossover * 1.15, 2, "auto: hierarchical from here", fontsize=10, color="0.3")
    ax.set_xlabel("tensor bytes S")
    ax.set_ylabel("ms (model)")
    ax.set_title("All-reduce on 2 nodes x 2 ranks, Lab 11's emulated links: each step costs its "
                 "slowest link")
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig


def degraded_link_timeline() -> Figure:
    """Ring all-reduce steps on 4 nodes of one rank, healthy and with node 2's link at half
    bandwidth: every step waits for the slowest link."""
    nbytes, n = 4 * 2**20, 4
    panels = (("healthy: every link between nodes at 25 MB/s", TwoTier(ranks_per_node=1)),
              ("node 2's link at half bandwidth: ranks 1 and 2 send over it",
               TwoTier(ranks_per_node=1, degraded={2: 0.5})))
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.8))
    ends = []
    for ax, (title, links) in zip(axes, panels, strict=True):
        events, waiting, start = [], {f"rank {r}": [] for r in range(n)}, 0.0
        for step in range(2 * (n - 1)):
            took = {r: links.link(r, (r + 1) % n).alpha
                    + nbytes / n * links.link(r, (r + 1) % n).beta for r in range(n)}
            end = start + max(took.values())
            for r in range(n):
                events.append(Event(r, "send", str(step + 1), start, start + took[r]))
                if start + took[r] < end:
                    waiting[f"rank {r}"].append((start + took[r], end))
            start = end  # the next step starts when the slowest rank's send arrives
        ends.append(start)
        slow = {r for r in range(n) if links.link(r, (r + 1) % n) != links.inter}
        plot_events(events, style=lambda e, slow=slow: {
            "facecolor": "tab:red" if e.rank in slow else "tab:blue", "edgecolor": "white"},
            label=lambda e: e.name, spans=waiting, ax=ax, title=title)
    for ax in axes:
        ax.set_xlim(0, max(ends) * 1e3 * 1.02)
        ax.title.set_fontsize(12)
    axes[0].set_xlabel("")
    axes[1].set_xlabel("ms: ring all-reduce of 4 MiB, one box per rank and step (its send); "
                       "hatched: waiting for the slowest link")
    fig.tight_layout()
    return fig


def pairwise_sweep() -> Figure:
    """What a pairwise sweep of 8 nodes shows when node 5's link runs at half bandwidth
    (bandwidths from the link model)."""
    links = TwoTier(ranks_per_node=1, inter_bandwidth=50e9, degraded={5: 0.5}, emulated=False)
    n = 8
    grid = [[float("nan") if a == b else links.link(a, b).bandwidth / 1e9 for b in range(n)]
            for a in range(n)]
    fig, ax = plt.subplots(figsize=(5.6, 4.4))
    image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=55)
    fig.colorbar(image, label="GB/s, each way")
    ax.set_xticks(range(n), [f"n{i}" for i in range(n)])
    ax.set_yticks(range(n), [f"n{i}" for i in range(n)])
    ax.set_title("pairwise sweep, 8 nodes: every pair\nwith node 5 at half of 50 GB/s")
    fig.tight_layout()
    return fig



# --- Lab 14: the capstone ----------------------------------------------------------------------


def capstone_wiring() -> Figure:
    """The order in which the capstone wires its pieces, each tested before the next: the lab
    that built it, and what checks it once it is in."""
    steps = [
        ("mesh groups", "Lab 07", "each rank in one group\nper dimension"),
        ("one stage,\nno TP", "Lab 06", "pp alone equals\none process"),
        ("TP shards\n(f and g)", "Lab 05", "TP added: still\none process's numbers"),
        ("DP average", "Lab 03", "replicas stay equal"),
        ("NaN guard", "Lab 09", "every rank skips\nthe same step"),
        ("checkpoint,\nresume", "Lab 09", "kill, resume:\nthe same bits"),
        ("profile", "Lab 08", "exposed communication,\nMFU"),
    ]
    fig, ax = _canvas(12.5, 3.4, (0, 7 * 1.8), (-0.2, 3.1))
    for k, (piece, lab, check) in enumerate(steps):
        x = k * 1.8
        _box(ax, x + 0.05, 1.5, 1.45, 1.1, piece, color="#dbe9f6", size=11)
        ax.text(x + 0.775, 2.8, lab, ha="center", fontsize=11, color="0.25")
        ax.text(x + 0.775, 1.15, check, ha="center", va="top", fontsize=9.5, color="0.2")
        if k:
            _arrow(ax, (x - 0.3, 2.05), (x + 0.05, 2.05))
    ax.text(0.05, -0.15, "add one piece, run the equality check against one process, then the "
            "next: a failure then has one suspect", fontsize=11, color="0.2")
    return fig

FIGURES: dict[str, Callable[[], Figure]] = {
    "model-state-against-gpu": model_state_against_gpu,
    "spmd-ranks": spmd_ranks,
    "rendezvous": rendezvous,
    "deadlock": deadlock,
    "send-recv": send_recv,
    "broadcast-reduce-all-reduce": collectives_part_one,
    "all-gather-reduce-scatter-send": collectives_part_two,
    "reduce-scatter-then-all-gather": reduce_scatter_then_all_gather,
    "ring-phases": ring_phases,
    "ring-reduce-scatter-steps": ring_reduce_scatter_steps,
    "ring-bytes-against-n": ring_bytes_against_n,
    "alpha-beta-time": alpha_beta_time,
    "all-reduce-algorithms": all_reduce_algorithms,
    "algbw-busbw": algbw_busbw,
    "sixteen-bytes": sixteen_bytes,
    "activations-one-device": activations_one_device,
    "recompute-schedule": recompute_schedule,
    "one-gpu-memory": one_gpu_memory,
    "link-bandwidth": link_bandwidth,
    "roofline-h100": roofline_h100,
    "zero-stages-7.5b": zero_stages_7_5b,
    "memory-bars-7b": memory_bars_7b,
    "comm-volume-by-stage": comm_volume_by_stage,
    "data-parallel-split": data_parallel_split,
    "ddp-three-versions": ddp_three_versions,
    "ddp-bucket-timeline": ddp_bucket_timeline,
    "no-sync-timeline": no_sync_timeline,
    "step-time-against-bucket-size": step_time_against_bucket_size,
    "zero-sharding-layout": zero_sharding_layout,
    "zero-memory-against-n": zero_memory_against_n,
    "fsdp-unit-timeline": fsdp_unit_timeline,
    "fsdp-units-gathered": fsdp_units_gathered,
    "linear-splits": linear_splits,
    "tensor-parallel-mlp": tensor_parallel_mlp,
    "sequence-parallel-mlp": sequence_parallel_mlp,
    "tensor-parallel-activations": tensor_parallel_activations,
    "tensor-parallel-time": tensor_parallel_time_in_and_across_nodes,
    "naive-pipeline": naive_pipeline,
    "gpipe": gpipe_only,
    "interleaved-chunks": interleaved_chunks,
    "backward-split": backward_split,
    "mesh-groups-8": mesh_groups_8,
    "mesh-on-nodes": mesh_on_nodes,
    "bytes-per-dimension-7b": bytes_per_dimension_7b,
    "moe-dispatch": moe_dispatch,
    "moe-capacity": moe_capacity,
    "parameter-server-time": parameter_server_time_against_n,
    "staleness-convergence": staleness_convergence,
    "compressed-bytes-against-n": compressed_bytes_against_n,
    "async-tp-timeline": async_tp_timeline,
    "checkpoint-waste-against-interval": checkpoint_waste_against_interval,
    "resharding-overlaps": resharding_overlaps,
    "lost-work-timeline": lost_work_timeline,
    "async-checkpoint-timeline": async_checkpoint_timeline,
    "profiled-flat-and-buckets": profiled_flat_and_buckets,
    "straggler-timeline": straggler_timeline,
    "mfu-and-hfu-by-recompute": mfu_and_hfu_by_recompute,
    "scaling-efficiency": scaling_efficiency,
    "tiers-bytes": tiers_bytes,
    "offload-transfer-timeline": offload_transfer_timeline,
    "offload-step-time": offload_step_time,
    "fsdp1-fsdp2-map": fsdp1_fsdp2_map,
    "held-after-forward": held_after_forward,
    "clipping-pieces": clipping_pieces,
    "long-context-activations": long_context_activations,
    "ring-attention-steps": ring_attention_steps,
    "online-softmax-merge": online_softmax_merge,
    "zigzag-layout": zigzag_layout,
    "ring-against-all-to-all": ring_against_all_to_all,
    "two-tier-network": two_tier_network,
    "hierarchical-phases": hierarchical_phases,
    "inter-node-bytes": inter_node_bytes,
    "two-tier-time-against-size": two_tier_time_against_size,
    "degraded-link-timeline": degraded_link_timeline,
    "pairwise-sweep": pairwise_sweep,
    "capstone-wiring": capstone_wiring,
}


def draw(name: str) -> tuple[bytes, str]:
    """The named figure as PNG bytes, and its fingerprint."""
    if name not in FIGURES:
        raise SystemExit(f"unknown figure:{name}; known: {', '.join(sorted(FIGURES))}")
    with plt.rc_context(STYLE):
        figure = FIGURES[name]()
        shown = fingerprint(figure)
        return png_bytes(figure), shown


def fingerprint(figure: Figure) -> str:
    """What a figure shows, whatever machine renders it: its texts, and its data in each axes'
    own coordinates, to 6 significant digits. Left out: whatever the layout places from font
    sizes (tick labels, arrows' ends), since fonts differ between machines."""
    shown: list = [text.get_text() for text in figure.texts]
    for ax in figure.axes:
        shown += [ax.get_title(loc) for loc in ("left", "center", "right")]
        shown += [ax.get_xlabel(), ax.get_ylabel(), _rounded(ax.get_xlim()),
                  _rounded(ax.get_ylim())]
        shown += [(text.get_text(), _rounded(text.get_position())) for text in ax.texts]
        shown += [_rounded(line.get_xydata()) for line in ax.lines]
        shown += [type(patch).__name__ if isinstance(patch, FancyArrowPatch) else
                  _rounded(patch.get_patch_transform().transform(patch.get_path().vertices))
                  for patch in ax.patches]
        shown += [_rounded(collection.get_offsets()) for collection in ax.collections]
        shown += [_rounded(image.get_array()) for image in ax.images]
        if ax.get_legend() is not None:
            shown += [text.get_text() for text in ax.get_legend().get_texts()]
    return hashlib.sha256(repr(shown).encode()).hexdigest()[:16]


def _rounded(values) -> list[float]:
    return [float(f"{value:.6g}") + 0.0 for value in np.ravel(np.asarray(values, dtype=float))]
