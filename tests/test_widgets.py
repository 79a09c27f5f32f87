"""Lab 02's live widgets, driven like a student would, without a browser."""

import base64

import matplotlib
import pytest

from minidist.costs import bubbles, memory
from minidist.costs.planner import MODELS
from minidist.parallel import pipeline, pipeline_simulator
from minidist.pictures import widgets
from minidist.pictures.widgets import (
    BubbleExplorer,
    DeviceMemoryCalculator,
    MemoryCalculator,
    memory_by_zero_stage,
    memory_on_one_device,
)

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
    calculator.controls["recompute"].value = "none"
    assert calculator.data[3].activations > full
    assert calculator.controls["recompute"].label == "none"  # ipywidgets 8 shows None as blank
    assert calculator.figure.axes[0].get_title().endswith("recompute=none")
    calculator.controls["gpu_memory_gb"].value = 141
    assert "in 141 GB" in calculator.message


def test_device_memory_calculator_is_one_gpu_alone():
    calculator = DeviceMemoryCalculator(model="7B", seq_len=4096)
    estimates = calculator.data
    assert list(estimates) == ["none", "selective", "full"]
    assert bar_tops(calculator.figure) == pytest.approx(
        [estimate.total / memory.GB for estimate in estimates.values()])
    state = memory.model_state_bytes(MODELS["7B"].num_params)  # 16 bytes per parameter
    assert all(e.params + e.grads + e.optimizer == state.total for e in estimates.values())
    assert estimates["none"].activations > estimates["selective"].activations > estimates[
        "full"].activations
    assert "does NOT fit in 80 GB" in calculator.message  # 107 GB of model state alone
    calculator.controls["model"].value = "1.3B"
    calculator.controls["recompute"].value = "full"
    assert "fits in 80 GB" in calculator.message and "recompute=full" in calculator.message
    fp32 = memory_on_one_device(MODELS["1.3B"], precision="fp32")["full"]
    assert (fp32.params, fp32.grads) == (4 * 1.3e9, 4 * 1.3e9)
    assert memory_on_one_device(MODELS["1.3B"], seq_len=4096)["none"].activations > \
        memory_on_one_device(MODELS["1.3B"], seq_len=2048)["none"].activations


def test_memory_calculator_shows_no_recompute_as_none():
    calculator = MemoryCalculator()
    assert calculator.controls["recompute"].value == "none"
    assert calculator.controls["recompute"].label == "none"
    assert "recompute=None" not in calculator.figure.axes[0].get_title()


def test_memory_calculator_reports_impossible_layouts():
    calculator = MemoryCalculator(model="13B")  # 40 heads, 40 layers
    calculator.controls["tp"].value = 16
    assert calculator.figure is None and "tp=16 does not divide heads=40" in calculator.message
    calculator.controls["tp"].value = 8
    calculator.controls["pp"].value = 16
    assert "pp=16 does not divide layers=40" in calculator.message
    calculator.controls["pp"].value = 8
    assert calculator.figure is not None


def test_memory_by_zero_stage_pipeline_keeps_first_rank_activations():
    one = memory_by_zero_stage(MODELS["70B"], dp=8, tp=8, pp=1, recompute="selective")[1]
    eight = memory_by_zero_stage(MODELS["70B"], dp=1, tp=8, pp=8, recompute="selective")[1]
    assert eight.params == one.params / 8
    logits = 4 * 4096 * 32000 / 8  # on the last rank, which is also the first when pp=1
    assert eight.activations == pytest.approx(one.activations - logits)


def test_bubble_explorer_measures_and_prints_the_bubble():
    explorer = BubbleExplorer(schedule="gpipe", ranks=4, microbatches=1)
    assert "75.0% of the timeline measured, 75.0% by bubble_fraction" in explorer.message
    explorer.controls["microbatches"].value = 8
    assert "27.3%" in explorer.message and "37.5% relative to ideal" in explorer.message
    events = [event for events in explorer.data.events for event in events]
    assert len(events) == 4 * 8 * 2  # F and B per rank per microbatch
    explorer.controls["schedule"].value = "zb-h1"
    assert "11.1% of the timeline" in explorer.message  # 3 / (3·8 + 3)
    assert {e.kind for events in explorer.data.events for e in events} == {"F", "B", "W"}
    explorer.controls["schedule"].value = "interleaved"
    explorer.controls["chunks"].value = 2
    assert f"{bubbles.bubble_fraction('interleaved', 4, 8, 2):.1%}" in explorer.message
    explorer.controls["microbatches"].value = 6
    assert explorer.figure is None
    assert "microbatches=6 is not a multiple of ranks=4" in explorer.message
    explorer.controls["schedule"].value = "1f1b"  # chunks only apply to interleaved
    assert explorer.figure is not None and "bubble" in explorer.message


def test_bubble_explorer_and_lab_06_simulator_agree(monkeypatch):
    """Lab 02's explorer and Lab 06 (pipeline_simulator.simulate on pipeline.schedule) give the
    same timeline and bubble for every schedule the explorer offers, across its p, m and v."""
    monkeypatch.setattr(widgets.gantt, "draw", lambda timeline: None)  # bubbles, not pictures
    explorer = BubbleExplorer()
    assert list(explorer.controls["schedule"].options) == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    for name in explorer.controls["schedule"].options:
        for p in (1, 2, 3, 4, 8):
            for m in sorted({1, p, 2 * p, 32}):
                for v in ((1, 2, 4) if name == "interleaved" else (1,)):
                    if (name == "interleaved" and m % p) or (name == "zb-h1" and m < p):
                        continue  # the explorer says why these are not possible
                    explorer = BubbleExplorer(name, p, m, v)
                    lab_06 = pipeline_simulator.simulate(pipeline.schedule(name, p, m, v))
                    assert explorer.data.events == lab_06.events, (name, p, m, v)
                    assert explorer.data.bubble_fraction == lab_06.bubble_fraction
                    assert explorer.data.bubble_fraction == pytest.approx(
                        bubbles.bubble_fraction(name, p, m, v)), (name, p, m, v)


def test_output_area_shows_the_message_and_the_figure_in_one_state():
    """The output area's state is set, not captured from print/display: a headless runner
    (nbgrader's autograde) then has nothing to send back to the kernel mid-cell."""
    explorer = BubbleExplorer(schedule="gpipe", ranks=4, microbatches=1)
    explorer.controls["microbatches"].value = 8
    text, image = explorer.output.outputs
    assert text == {"output_type": "stream", "name": "stdout", "text": explorer.message + "\n"}
    png = base64.b64decode(image["data"]["image/png"])
    assert png.startswith(b"\x89PNG"), f"expected a PNG, got {png[:8]!r}"
    explorer.controls["microbatches"].value = 6
    explorer.controls["schedule"].value = "interleaved"  # m=6 is not a multiple of p=4
    assert explorer.output.outputs == (
        {"output_type": "stream", "name": "stdout", "text": explorer.message + "\n"},
    ), f"expected only the message, got {explorer.output.outputs}"
