"""Pictures the labs show beside their exercises (and the slides beside their text).

    draw_collectives()          # one row per collective, 4 ranks (lab 01)
    draw_collectives(["all_reduce", "reduce_scatter"], world_size=3)
    draw_ring(4)                # the ring and what each phase of ring all-reduce must leave
    draw_roofline({"H100, InfiniBand": (989e12, 50e9)}, points={"a step": 5e3})   # lab 02
    draw_linear_splits(2)       # column- and row-parallel nn.Linear (lab 05)
    draw_tensor_parallel_mlp()  # Megatron's MLP with f and g (sequence_parallel=True: SP's pair)
    draw_mesh_groups({"pp": 2, "dp": 2, "tp": 2})   # the groups of each mesh dimension (lab 07)
    draw_two_tiers(TwoTier(ranks_per_node=2), 4)   # nodes, their ranks, both links (lab 11)

Each rank is a row of boxes, one box per chunk of its tensor. A box shows which chunk it
holds ("a1" = chunk a from rank 1) or a reduction ("Σa" = chunk a summed over all ranks).
"""

from __future__ import annotations

import itertools
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from minidist.communication.network import TwoTier

__all__ = ["Layout", "COLLECTIVES", "draw_collectives", "draw_ring", "draw_roofline",
           "draw_linear_splits", "draw_tensor_parallel_mlp", "draw_mesh_groups",
           "draw_two_tiers"]

Layout = list[list[str]]  # per rank, the label of each chunk box ("" = empty)

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _before_after(name: str, n: int) -> tuple[Layout, Layout, str]:
    """Box labels before and after `name` on `n` ranks, and a one-line description."""
    chunks = string.ascii_lowercase[:n]
    own = [[f"{c}{r}" for c in chunks] for r in range(n)]  # every rank holds its own data
    summed = [f"Σ{c}" for c in chunks]
    empty = [""] * n
    if name == "broadcast":
        return ([list(chunks)] + [empty] * (n - 1), [list(chunks)] * n,
                "rank 0's tensor is copied to every rank")
    if name == "reduce":
        return own, [summed] + [empty] * (n - 1), "the sum of all ranks' tensors lands on rank 0"
    if name == "all_reduce":
        return own, [summed] * n, "every rank gets the sum of all ranks' tensors"
    if name == "all_gather":
        pieces = [[f"x{r}" if i == r else "" for i in range(n)] for r in range(n)]
        return pieces, [[f"x{i}" for i in range(n)]] * n, "every rank gets every rank's piece"
    if name == "reduce_scatter":
        after = [[summed[i] if i == r else "" for i in range(n)] for r in range(n)]
        return own, after, "rank r gets chunk r of the sum"
    if name == "send_recv":
        before = [list(chunks)] + [empty] * (n - 1)
        return before, [list(chunks)] * 2 + [empty] * (n - 2), "rank 0 sends its tensor to rank 1"
    raise ValueError(f"unknown collective {name!r}; choose from {', '.join(COLLECTIVES)}")


def draw_collectives(names: list[str] | None = None, world_size: int = 4) -> Figure:
    """A figure with one row per collective: the ranks' data before and after it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    names = list(COLLECTIVES) if names is None else names
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 to show communication, got {world_size}")
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(names), 2, figsize=(8, 1.1 + 0.55 * world_size * len(names)),
                             squeeze=False)
    for row, name in enumerate(names):
        before, after, description = _before_after(name, world_size)
        for ax, layout, when in ((axes[row][0], before, "before"), (axes[row][1], after, "after")):
            for rank, boxes in enumerate(layout):
                y = world_size - 1 - rank
                ax.text(-0.15, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
                for i, label in enumerate(boxes):
                    reduced = label.startswith("Σ")
                    face = colors(i) if label else "white"
                    ax.add_patch(Rectangle((i, y), 0.9, 0.8, facecolor=face, edgecolor="grey",
                                           alpha=0.9 if reduced else 0.35))
                    ax.text(i + 0.45, y + 0.4, label, ha="center", va="center", fontsize=8,
                            fontweight="bold" if reduced else "normal")
            ax.set_xlim(-1.1, world_size)
            ax.set_ylim(-0.2, world_size)
            ax.axis("off")
            ax.set_title(f"{name} — {when}" if when == "before" else when, fontsize=9, loc="left")
        axes[row][1].text(world_size, -0.15, description, ha="right", va="top", fontsize=8,
                          style="italic")
    fig.tight_layout()
    return fig


def draw_linear_splits(tp: int = 2) -> Figure:
    """nn.Linear's weight [out, in] split across `tp` ranks, both ways, with what each rank
    computes: column-parallel (rows of W: a slice of y) and row-parallel (columns of W and
    of x: a partial sum of all of y)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if tp < 2:
        raise ValueError(f"tp must be at least 2 to show a split, got {tp}")
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    size = 4.0  # W is drawn as a size × size square; x and y as bars beside it
    for ax, kind in zip(axes, ("column", "row"), strict=True):
        band = size / tp
        for r in range(tp):
            if kind == "column":  # rank r owns rows of W (output features) and that slice of y
                ax.add_patch(Rectangle((0, size - (r + 1) * band), size, band,
                                       color=colors(r), alpha=0.6))
                ax.add_patch(Rectangle((size + 1.0, size - (r + 1) * band), 0.5, band,
                                       color=colors(r), alpha=0.6))
                ax.text(size / 2, size - (r + 0.5) * band, f"rank {r}", ha="center", va="center")
            else:  # rank r owns columns of W (input features) and that slice of x
                ax.add_patch(Rectangle((r * band, 0), band, size, color=colors(r), alpha=0.6))
                ax.add_patch(Rectangle((r * band, size + 0.4), band, 0.5, color=colors(r),
                                       alpha=0.6))
                ax.text((r + 0.5) * band, size / 2, f"rank {r}", ha="center", va="center",
                        rotation=90)
        ax.add_patch(Rectangle((0, 0), size, size, fill=False, lw=1.5))
        if kind == "column":
            ax.add_patch(Rectangle((0, size + 0.4), size, 0.5, color="0.75"))
            ax.text(size / 2, size + 0.65, "x (whole, on every rank)", ha="center", va="center")
            ax.text(size + 1.25, size + 0.65, "y", ha="center", va="center")
            ax.set_title("column-parallel: W's output rows split (weight dim 0)\n"
                         "each rank computes its slice of y; no sum needed")
        else:
            ax.add_patch(Rectangle((size + 1.0, 0), 0.5, size, color="0.75"))
            ax.text(size / 2, size + 1.15, "x (each rank holds its slice)", ha="center")
            ax.text(size + 1.25, size / 2, "y = Σ partial\n(all-reduce)", ha="left",
                    va="center", fontsize=8)
            ax.set_title("row-parallel: W's input columns split (weight dim 1)\n"
                         "each rank computes a partial sum of all of y")
        ax.text(-0.3, size / 2, "out", ha="right", va="center")
        ax.text(size / 2, -0.35, "in", ha="center", va="top")
        ax.set_xlim(-1, size + 3)
        ax.set_ylim(-1, size + 1.6)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def draw_two_tiers(tiers: TwoTier, world_size: int, ax: Axes | None = None) -> Axes:
    """The nodes of a `minidist.communication.network.TwoTier` network on `world_size` ranks: each
    node a box of its ranks joined by fast intra-node links, each rank's own port down to the switch
    between nodes; a degraded node's ports in red, with the bandwidth they keep."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyBboxPatch

    nodes, g = tiers.nodes(world_size), tiers.ranks_per_node
    if ax is None:
        ax = plt.subplots(figsize=(1.9 * nodes * max(g, 2) / 2 + 1.5, 3.2))[1]
    width = 1.2 * g
    for node in range(nodes):
        left = node * (width + 0.8)
        kept = tiers.degraded.get(node, 1.0)
        ax.add_patch(FancyBboxPatch((left, 1.3), width, 1.3, boxstyle="round,pad=0.05",
                                    facecolor="#eef3fb", edgecolor="0.4"))
        ax.text(left + width / 2, 2.75, f"node {node}", ha="center", fontsize=9)
        xs = [left + 0.6 + 1.2 * local for local in range(g)]
        for a, b in itertools.pairwise(xs):
            ax.plot([a, b], [1.95, 1.95], color="tab:green", lw=4, zorder=1)
        for local, x in enumerate(xs):
            ax.add_patch(Circle((x, 1.95), 0.3, facecolor="white", edgecolor="0.2", zorder=2))
            ax.text(x, 1.95, str(node * g + local), ha="center", va="center", zorder=3)
            ax.plot([x, x], [1.65, 0.55], color="tab:red" if kept < 1 else "tab:blue",
                    lw=1.5, ls="--" if kept < 1 else "-")
        if kept < 1:
            ax.text(left + width / 2, 1.05, f"at {kept:.0%}", ha="center", color="tab:red",
                    fontsize=8, backgroundcolor="white")
    total = nodes * (width + 0.8) - 0.8
    ax.add_patch(FancyBboxPatch((0, 0.25), total, 0.3, boxstyle="round,pad=0.02",
                                facecolor="0.85", edgecolor="0.4"))
    ax.text(total / 2, 0.4, "switch between nodes", ha="center", va="center", fontsize=8)
    speed = {name: f"{getattr(tiers, name + '_bandwidth') / 1e6:g} MB/s and "
                   f"{getattr(tiers, name + '_latency') * 1e6:g} us each way"
             for name in ("intra", "inter")}
    ax.text(0, -0.2, f"green: inside a node, {speed['intra']}\nblue: between nodes, "
            f"{speed['inter']}" + ("  (EMULATED)" if tiers.emulated else ""), fontsize=8,
            va="top")
    ax.set_xlim(-0.3, total + 0.3)
    ax.set_ylim(-0.9, 3.0)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def draw_ring(world_size: int = 4) -> Figure:
    """The ring of ring all-reduce: each rank sends to its right neighbour and receives from
    its left; and what each phase must leave on each rank (rank r owns chunk r after the
    reduce-scatter, every chunk summed everywhere after the all-gather). Which chunk moves at
    which step is left out: that is the exercise."""
    import math

    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch, Rectangle

    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 to show a ring, got {world_size}")
    n, chunks = world_size, string.ascii_lowercase[:world_size]
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), gridspec_kw={"width_ratios": [1.2, 1, 1, 1]})
    ring = axes[0]
    where = [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]
    for r, (x, y) in enumerate(where):
        ring.add_patch(Circle((x, y), 0.25, facecolor="0.92", edgecolor="0.3"))
        ring.text(x, y, f"rank {r}", ha="center", va="center", fontsize=8)
        nx, ny = where[(r + 1) % n]
        ring.add_patch(FancyArrowPatch((x, y), (nx, ny), shrinkA=20, shrinkB=20,
                                       connectionstyle="arc3,rad=-0.25", arrowstyle="-|>",
                                       mutation_scale=12, color="0.2"))
    ring.set_xlim(-1.5, 1.5)
    ring.set_ylim(-1.5, 1.5)
    ring.set_aspect("equal")
    ring.axis("off")
    ring.set_title("each step: send one chunk right,\nreceive one from the left", fontsize=9)
    layouts = (
        ("start: rank r's own tensor", [[f"{c}{r}" for c in chunks] for r in range(n)]),
        ("after the reduce-scatter (N−1 steps)",
         [[f"Σ{c}" if i == r else "" for i, c in enumerate(chunks)] for r in range(n)]),
        ("after the all-gather (N−1 more)", [[f"Σ{c}" for c in chunks]] * n),
    )
    for ax, (title, layout) in zip(axes[1:], layouts, strict=True):
        for r, boxes in enumerate(layout):
            y = n - 1 - r
            ax.text(-0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
            for i, label in enumerate(boxes):
                reduced = label.startswith("Σ")
                ax.add_patch(Rectangle((i, y), 0.9, 0.8, facecolor=colors(i) if label else "white",
                                       edgecolor="grey", alpha=0.9 if reduced else 0.35))
                ax.text(i + 0.45, y + 0.4, label, ha="center", va="center", fontsize=8,
                        fontweight="bold" if reduced else "normal")
        ax.set_xlim(-1.1, n)
        ax.set_ylim(-0.2, n)
        ax.axis("off")
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def draw_roofline(roofs: dict[str, tuple[float, float]], points: dict[str, float] | None = None,
                  title: str = "") -> Figure:
    """Compute against a link, as a roofline (Williams, Waterman & Patterson 2009): for each
    roof, name -> (peak FLOP/s, link bytes/s), the FLOP/s a step can reach when it moves one
    byte over the link per `intensity` FLOPs and the two overlap: min(peak, intensity x
    bandwidth). Left of a roof's ridge point (peak / bandwidth FLOPs per byte) the link sets
    the pace; right of it the transfer hides under compute. `points`: name -> intensity,
    marked as vertical lines (a strategy's FLOPs per byte it sends)."""
    import matplotlib.pyplot as plt
    import numpy as np

    if not roofs:
        raise ValueError("give at least one roof: {name: (peak FLOP/s, bytes/s)}")
    for name, (peak, bandwidth) in roofs.items():
        if not (peak > 0 and bandwidth > 0):
            raise ValueError(f"{name}: peak={peak} FLOP/s and bandwidth={bandwidth} B/s "
                             "must be > 0")
    ridges = [peak / bandwidth for peak, bandwidth in roofs.values()]
    marked = list((points or {}).values())
    low = min(ridges + marked) / 30
    high = max(ridges + marked) * 30
    intensity = np.logspace(np.log10(low), np.log10(high), 200)
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, (peak, bandwidth) in roofs.items():
        line, = ax.loglog(intensity, np.minimum(peak, intensity * bandwidth), lw=2,
                          label=f"{name}: ridge at {peak / bandwidth:,.0f} FLOPs/byte")
        ax.plot([peak / bandwidth], [peak], "o", color=line.get_color())
    for name, value in (points or {}).items():
        ax.axvline(value, color="0.4", ls="--", lw=1)
        ax.text(value, 0.97, f" {name} ", rotation=90, va="top", ha="right", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("arithmetic intensity: FLOPs computed per byte moved over the link")
    ax.set_ylabel("FLOP/s reachable (transfer overlapped)")
    ax.set_title(title or "compute against a link: left of a ridge the link sets the pace",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    return fig


def _box(ax, x: float, y: float, w: float, h: float, text: str, color: str = "0.9",
         size: int = 11, **text_args) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="0.3", lw=1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, **text_args)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float]) -> None:
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color="0.2",
                                 lw=1.4))


def draw_tensor_parallel_mlp(sequence_parallel: bool = False) -> Figure:
    """Megatron's MLP on 2 ranks: the operator entering the split region, fc1 column-parallel,
    GELU, fc2 row-parallel, the operator leaving it; under each operator what it runs forward
    and backward. With `sequence_parallel` the input and output are sequence slices and the
    operators are all-gather / reduce-scatter (Korthikanti et al. 2022 §4.2.2)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 3.9))
    ax.set_xlim(0, 12.4)
    ax.set_ylim(-0.2, 4.1)
    ax.axis("off")
    if sequence_parallel:  # Korthikanti's names: g enters the split layers, ḡ leaves them
        entry = ("g", "fwd: all-gather seq\nbwd: reduce-scatter")
        exit_ = ("ḡ", "fwd: reduce-scatter seq\nbwd: all-gather")
        x_in, z_out = "X_r\n(seq slice r)", "Z_r"
    else:
        entry = ("f", "fwd: identity\nbwd: all-reduce")
        exit_ = ("g", "fwd: all-reduce\nbwd: identity")
        x_in, z_out = "X\n(whole)", "Z"
    _box(ax, 0.1, 1.5, 1.2, 1.0, x_in, "0.9", size=10)
    _arrow(ax, (1.3, 2.0), (1.8, 2.0))
    _box(ax, 1.8, 1.5, 1.0, 1.0, entry[0], "#fde9b6", size=16, fontweight="bold")
    ax.text(2.3, 1.3, entry[1], ha="center", va="top", fontsize=9)
    for r in range(2):
        y = 2.5 - r * 2.0
        color = to_hex(colors(r)) + "66"
        _arrow(ax, (2.8, 2.0), (3.4, y + 0.5))
        _box(ax, 3.4, y, 2.0, 1.0, f"X·A{r}ᵀ\n(fc1 rows {r}: column)", color, size=10)
        _arrow(ax, (5.4, y + 0.5), (5.9, y + 0.5))
        _box(ax, 5.9, y, 1.2, 1.0, "GELU", color, size=10)
        _arrow(ax, (7.1, y + 0.5), (7.6, y + 0.5))
        _box(ax, 7.6, y, 2.0, 1.0, f"Y{r}·B{r}ᵀ\n(fc2 cols {r}: row)", color, size=10)
        _arrow(ax, (9.6, y + 0.5), (10.1, 2.0))
        ax.text(4.4, y + 1.1 if r == 0 else y - 0.3, f"rank {r}", ha="center", fontsize=10)
    _box(ax, 10.1, 1.5, 1.0, 1.0, exit_[0], "#fde9b6", size=16, fontweight="bold")
    ax.text(10.6, 1.3, exit_[1], ha="center", va="top", fontsize=9)
    _arrow(ax, (11.1, 2.0), (11.5, 2.0))
    ax.text(11.55, 2.0, z_out + " + fc2 bias", va="center", fontsize=10)
    ax.text(6.5, 3.85, "no communication between fc1 and fc2: Y's column slice is fc2's row "
            "slice", ha="center", fontsize=10, style="italic")
    fig.tight_layout()
    return fig


def draw_mesh_groups(shape: dict[str, int]) -> Figure:
    """The ranks of a mesh of three named dimensions (slowest first, row-major numbering),
    one panel per dimension, coloured by the group along it that each rank belongs to."""
    import math

    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from minidist.communication.mesh import group_ranks  # the groups, worked out in one place

    if len(shape) != 3:
        raise ValueError(f"draw_mesh_groups draws three dimensions, got {shape}")
    colors = plt.get_cmap("tab10")
    (outer, n0), (middle, n1), (inner, n2) = shape.items()
    world = math.prod(shape.values())
    strides = {outer: n1 * n2, middle: n2, inner: 1}
    sizes = dict(shape)

    def coord(rank: int, dim: str) -> int:
        return rank // strides[dim] % sizes[dim]

    def groups(dim: str) -> list[list[int]]:
        return group_ranks(sizes, dim)

    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 1.2 + 0.95 * n1))
    for ax, dim in zip(axes, reversed(list(shape)), strict=True):
        colour_of = {rank: colors(k % 10) for k, group in enumerate(groups(dim)) for rank in group}
        for rank in range(world):
            x = coord(rank, outer) * (n2 + 0.6) + coord(rank, inner)
            y = (n1 - 1 - coord(rank, middle)) * 1.1
            _box(ax, x + 0.05, y, 0.85, 0.8, str(rank), to_hex(colour_of[rank]) + "77", size=13)
        for k in range(n0):
            ax.text(k * (n2 + 0.6) + n2 / 2, n1 * 1.1 - 0.05, f"{outer} {k}", ha="center",
                    fontsize=10)
        ax.set_xlim(-0.1, n0 * (n2 + 0.6))
        ax.set_ylim(-0.2, n1 * 1.1 + 0.4)
        ax.axis("off")
        ax.set_title(f"{dim} groups: " + " ".join(str(g) for g in groups(dim)), fontsize=10,
                     loc="left")
    fig.suptitle(f"{' × '.join(f'{d} = {n}' for d, n in shape.items())}: columns {inner}, "
                 f"rows {middle}, blocks {outer} (same colour = same group)", fontsize=11)
    fig.tight_layout()
    return fig
