"""The lab's live calculators, driven like a student would, without a browser."""

import matplotlib
import pytest

from minidist import memory
from minidist.calculators import (
    BubbleExplorer,
    MemoryCalculator,
    draw_timeline,
    pipeline_timeline,
    rank_memory,
)
from minidist.planner import MODELS

matplotlib.use("Agg")


def bar_tops(figure):
    """Height of each stacked bar (ZeRO-0..3) in GB, from the figure's rectangles."""
    tops = {}
    for patch in figure.axes[0].patches:
        if patch.get_fill():
            x = round(patch.get_x() + patch.get_width() / 2)
            tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    return [tops[i] for i in sorted(tops)]


def test_memory_calculator_follows_its_sliders():
    calculator = MemoryCalculator(model="70B", dp=64, tp=8, pp=1, recompute="selective")
    estimates = calculator.data
    assert bar_tops(calculator.figure) == pytest.approx(
        [estimates[z].total / memory.GB for z in range(4)])
    state = memory.model_state_bytes(70e9 / 8, 3, 64)
    assert estimates[3].optimizer == state.optimizer
    line = [line for line in calculator.figure.axes[0].lines][0]
    assert line.get_ydata()[0] == 80  # the GPU's memory, GB

    before = calculator.data[1].total
    calculator.controls["dp"].value = 8  # fewer ranks: bigger ZeRO shards
    assert calculator.data[1].total > before
    calculator.controls["zero_stage"].value = 3
    assert "ZeRO-3" in calculator.message and "fits in 80 GB" in calculator.message
    calculator.controls["seq_len"].value = 32768
    assert "does NOT fit" in calculator.message
    calculator.controls["recompute"].value = "full"
    full = calculator.data[3].activations
    calculator.controls["recompute"].value = None
    assert calculator.data[3].activations > full
    calculator.controls["gpu_memory_gb"].value = 141
    assert "in 141 GB" in calculator.message


def test_memory_calculator_reports_impossible_layouts():
    calculator = MemoryCalculator(model="13B")  # 40 heads, 40 layers
    calculator.controls["tp"].value = 16
    assert calculator.figure is None and "tp=16 does not divide heads=40" in calculator.message
    calculator.controls["tp"].value = 8
    calculator.controls["pp"].value = 16
    assert "pp=16 does not divide layers=40" in calculator.message
    calculator.controls["pp"].value = 8
    assert calculator.figure is not None


def test_rank_memory_pipeline_keeps_first_stage_activations():
    one = rank_memory(MODELS["70B"], dp=8, tp=8, pp=1, recompute="selective")[1]
    eight = rank_memory(MODELS["70B"], dp=1, tp=8, pp=8, recompute="selective")[1]
    assert eight.params == one.params / 8
    logits = 4 * 4096 * 32000 / 8  # on the last stage, which is also the first when pp=1
    assert eight.activations == pytest.approx(one.activations - logits)


def test_bubble_explorer_measures_and_prints_the_bubble():
    explorer = BubbleExplorer(schedule="gpipe", stages=4, microbatches=1)
    assert "75.0% of the timeline measured, 75.0% by bubble_fraction" in explorer.message
    explorer.controls["microbatches"].value = 8
    assert "27.3%" in explorer.message and "37.5% relative to ideal" in explorer.message
    assert len(explorer.data) == 4 * 8 * 2  # F and B per stage per microbatch
    explorer.controls["schedule"].value = "zb-h1"
    assert "11.1% of the timeline" in explorer.message  # 3 / (3·8 + 3)
    assert {op.kind for op in explorer.data} == {"F", "B", "W"}
    explorer.controls["schedule"].value = "interleaved"
    explorer.controls["chunks"].value = 2
    assert f"{memory.bubble_fraction('interleaved', 4, 8, 2):.1%}" in explorer.message
    explorer.controls["microbatches"].value = 6
    assert explorer.figure is None
    assert "microbatches=6 is not a multiple of stages=4" in explorer.message
    explorer.controls["schedule"].value = "1f1b"  # chunks only apply to interleaved
    assert explorer.figure is not None and "bubble" in explorer.message


def test_timeline_figure_has_a_box_per_pass():
    ops = pipeline_timeline("1f1b", 3, 4)
    figure = draw_timeline(ops, "1f1b")
    assert len(figure.axes[0].patches) == len(ops) == 3 * 4 * 2
    with pytest.raises(ValueError, match="schedule='zb-h2' has no timeline"):
        pipeline_timeline("zb-h2", 4, 8)
