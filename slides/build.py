"""Build the slide decks: each `slides/NN_topic.md` becomes a self-contained reveal.js deck
`NN_topic.html`, and `slides/index.html` lists them as a self-study path.

    .venv/bin/python slides/build.py          # rebuild every deck, the index and, when
                                              # Chromium is installed, slides/pdf/NN_topic.pdf
    .venv/bin/python slides/build.py --check  # exit 1 if a committed deck is out of date

Markdown: slides are separated by a line holding only `---`; a line holding only `Note:`
starts the slide's speaker notes. `$...$` and `$$...$$` are formulas (KaTeX). An image whose
address is `figure:<name>` is drawn by minidist at build time (slides/figures.py). The title
slide carries `**Covers:**`, `**Lab:**` and `**Time:**` lines.

The index is the self-study path: one step per lab in PATH below (prerequisites, objectives, a
self-check with answers on demand, its time, its deck and the learner's copy in my-labs/), with
what each deck covers. A lab whose deck is not written yet is listed as "deck coming"; a deck's
title and time must agree with its step.

reveal.js, its notes and search plugins, KaTeX (fonts included) and every figure are inlined,
so a deck is one HTML file that opens offline. They come from the npm registry, pinned in
slides/package-lock.json; the builder runs `npm ci` when slides/node_modules does not match.
PDFs are printed by the system's Chromium, driven by Playwright (the Python package pinned in
requirements.txt; it never downloads a browser of its own).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import html
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mistune

SLIDES = Path(__file__).resolve().parent
sys.path.insert(0, str(SLIDES))
import figures  # noqa: E402  (slides/figures.py, next to this file)

MODULES = SLIDES / "node_modules"
PDF_DIR = SLIDES / "pdf"
STYLE_SHEET = SLIDES / "deck.css"

# Reveal's math plugin fetches KaTeX from a URL; this one uses the copy inlined in the deck.
INIT = r"""
const printing = /print-pdf/.test(location.search);
const ScalingLabMath = {
  id: 'math',
  init: deck => renderMathInElement(deck.getSlidesElement(), {
    delimiters: [{left: '$$', right: '$$', display: true},
                 {left: '\\(', right: '\\)', display: false}],
    throwOnError: true,
  }),
};
Reveal.initialize({
  width: 1280,
  // Printed, each page is the slide with its notes below it: 720 px of slide, then notes.
  height: printing ? 1000 : 720,
  margin: 0.04,
  center: !printing,
  hash: true,
  slideNumber: 'c/t',
  showSlideNumber: 'all',
  showNotes: printing,
  pdfMaxPagesPerSlide: 1,
  transition: 'none',
  plugins: [RevealNotes, RevealSearch, ScalingLabMath],
});
"""


# --- Assets ------------------------------------------------------------------------------------


def ensure_node_modules() -> None:
    """`npm ci` unless slides/node_modules holds exactly what package-lock.json pins."""
    lock = json.loads((SLIDES / "package-lock.json").read_text())
    wanted = {path: entry["version"] for path, entry in lock["packages"].items() if path}
    installed = {}
    for path in wanted:
        manifest = SLIDES / path / "package.json"
        if manifest.exists():
            installed[path] = json.loads(manifest.read_text())["version"]
    if installed == wanted:
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("slides/build.py needs npm (Node.js) to fetch reveal.js and KaTeX; install "
                 "Node.js (e.g. apt-get install npm) and run it again")
    print("installing reveal.js and KaTeX into slides/node_modules (npm ci)")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=SLIDES,
                   check=True, timeout=600)


def _script(path: str) -> str:
    # A "</script" inside the code (reveal's notes plugin writes a page) would end the tag.
    code = (MODULES / path).read_text()
    return "<script>" + code.replace("</script", "<\\/script") + "</script>"


def _katex_css() -> str:
    """KaTeX's style sheet with its woff2 fonts inlined (every current browser reads woff2)."""
    dist = MODULES / "katex" / "dist"
    css = (dist / "katex.min.css").read_text()

    def inline(match: re.Match) -> str:
        font = base64.b64encode((dist / match[1]).read_bytes()).decode()
        return f"src:url(data:font/woff2;base64,{font}) format(\"woff2\")"

    css, count = re.subn(r"src:url\((fonts/[\w-]+\.woff2)\)[^;}]*", inline, css)
    if count == 0 or "url(fonts/" in css:
        sys.exit("KaTeX's CSS no longer names its fonts as slides/build.py expects; update "
                 "_katex_css for the pinned KaTeX version")
    return css


def assets() -> tuple[str, str]:
    """(everything for <head>, every <script> for the end of <body>), inlined."""
    ensure_node_modules()
    styles = [(MODULES / "reveal.js" / "dist" / "reveal.css").read_text(), _katex_css(),
              STYLE_SHEET.read_text()]
    head = "".join(f"<style>{style}</style>\n" for style in styles)
    scripts = [_script(path) for path in (
        "reveal.js/dist/reveal.js", "reveal.js/dist/plugin/notes.js",
        "reveal.js/dist/plugin/search.js", "katex/dist/katex.min.js",
        "katex/dist/contrib/auto-render.min.js")]
    return head, "\n".join(scripts) + f"\n<script>{INIT}</script>\n"


# --- Decks -------------------------------------------------------------------------------------


def _markdown() -> mistune.Markdown:
    renderer = mistune.HTMLRenderer(allow_harmful_protocols=("figure:",))
    return mistune.create_markdown(renderer=renderer,
                                   plugins=["table", "strikethrough", "math"])


_markdown_inline = mistune.create_markdown(renderer=mistune.HTMLRenderer())


@functools.cache
def _figure_attributes(name: str) -> str:
    """The figure's PNG inline, and its fingerprint, which `--check` compares instead."""
    png, fingerprint = figures.draw(name)
    return (f'src="data:image/png;base64,{base64.b64encode(png).decode()}" '
            f'data-figure="{name} {fingerprint}"')


def _without_pixels(deck: str) -> str:
    """A deck with its figures' PNG data left out: what `--check` compares (figures.py)."""
    return re.sub(r'src="data:image/png;base64,[^"]*" data-figure=', "data-figure=", deck)


def _title(markdown: str) -> str:
    title = re.search(r"^# (.+)$", markdown, re.MULTILINE)
    return title[1] if title else "Scaling Lab"


def render(markdown: str, head: str, scripts: str) -> str:
    """The HTML deck for one Markdown file."""
    to_html = _markdown()
    sections = []
    for number, source in enumerate(re.split(r"^---$", markdown, flags=re.MULTILINE), 1):
        parts = re.split(r"^Note:$", source, maxsplit=1, flags=re.MULTILINE)
        if len(parts) != 2 or not parts[1].strip():
            sys.exit(f"slide {number} ({source.strip().splitlines()[0][:60]!r}) has no "
                     "speaker notes: add a `Note:` line and the narration under it")
        slide, notes = parts
        body = re.sub(r'src="figure:([\w.-]+)"', lambda match: _figure_attributes(match[1]),
                      to_html(slide))
        sections.append(f"<section>\n{body}<aside class=\"notes\">\n{to_html(notes)}</aside>\n"
                        "</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(_title(markdown))}</title>\n{head}</head>\n<body>\n"
        '<div class="reveal"><div class="slides">\n' + "\n".join(sections)
        + f"\n</div></div>\n{scripts}</body>\n</html>\n"
    )


# --- The self-study path -----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One lab on the self-study path (slides/index.html). Text is inline Markdown."""

    lab: str  # "03_data_parallel": the deck slides/<lab>.md, the lab labs/<lab>/<lab>.ipynb
    title: str  # as the deck's first line says it: "# Lab 03 — <title>"
    time: str  # as the deck's `**Time:**` line says it
    needs: tuple[str, ...]  # "Lab NN: what of it" for an earlier lab, or an idea from outside
    objectives: tuple[str, ...]  # 2 to 4 things the learner can do after the step
    gate: tuple[tuple[str, str], ...]  # 2 or 3 (question, answer) to answer before moving on


# Every lab of the course, in order, with or without its deck yet. Numbers follow
# REFERENCES.md and the decks.
PATH = (
    Step("00_first_ranks", "First ranks", "about 30 min of slides, then the lab (1–2 h)",
         needs=("Python and PyTorch on one device: tensors, autograd, a training loop",),
         objectives=(
             "Start N ranks from a notebook cell, and say what a rank, the world size, a "
             "process group, a backend and the rendezvous are.",
             "Move tensors between ranks with `send` and `recv`, and explain why two ranks "
             "that both receive first wait forever.",
             "Read a failure on many ranks: the traceback of the rank that failed first, and "
             "where each rank of a hang was stuck.",
         ),
         gate=(
             ("`torchrun` starts 8 processes on each of 2 machines. What is the world size, and "
              "the local rank of global rank 11?",
              "World size **16**. Rank 11 is the fourth process on the second machine: local "
              "rank **3**."),
             ("Rank 2 raises; ranks 0, 1 and 3 report that their peer closed the connection. "
              "Whose traceback do you read first?",
              "**Rank 2's**: it failed first, and the others failed only because it was gone."),
             ("Why can every lab of this course run on a laptop without a GPU?",
              "The ranks use the **gloo** backend, which runs collectives on CPU tensors; the "
              "same code uses NCCL on NVIDIA GPUs."),
         )),
    Step("01_collectives", "Collectives", "about 35 min of slides, then the lab (2 h)",
         needs=("Lab 00: starting ranks, `send` and `recv`, and how mismatched calls deadlock",),
         objectives=(
             "Say what each of the six collectives leaves on every rank, and build an "
             "all-reduce from a reduce-scatter and an all-gather.",
             "Write ring all-reduce from `send` and `recv`, and count the bytes each rank "
             "sends: 2(N−1)/N·S.",
             "Predict a collective's time with the α-β model, tell latency-bound sizes from "
             "bandwidth-bound ones, and turn algbw into busbw.",
         ),
         gate=(
             ("Why does each rank of a ring all-reduce send less than 2S, however many ranks "
              "there are?",
              "It sends N−1 chunks of S/N in the reduce-scatter and N−1 in the all-gather: "
              "2(N−1)/N·S, which approaches 2S from below."),
             ("A 1 GB ring all-reduce goes from 8 to 16 ranks. What happens to the bytes each "
              "rank sends, and to the latency term?",
              "The bytes barely move: **1.75 → 1.875 GB** per rank. The latency term "
              "2(N−1)α more than doubles: **14α → 30α**."),
             ("Small messages on many ranks: ring or recursive doubling, and why?",
              "**Recursive doubling**: log₂N steps instead of the ring's 2(N−1), and at small "
              "sizes the α of each step is nearly the whole cost."),
         )),
    Step("02_memory_math", "One device and one link",
         "about 40 min of slides, then the lab (2 h)",
         needs=("Lab 01: the α-β model of a link",
                "A transformer's parts (embedding, attention, MLP, LayerNorm) and what "
                "backward computes"),
         objectives=(
             "Count the model state of mixed-precision Adam per parameter, say where each "
             "byte lives, and measure what PyTorch holds.",
             "Predict the activations a transformer layer keeps for backward, measure them "
             "tensor by tensor, and write full recompute.",
             "Count a step's FLOPs, and turn a throughput into MFU and HFU.",
             "Price a message on one link with the α-β model, and tell from a roofline when a "
             "transfer hides under compute.",
         ),
         gate=(
             ("Why does mixed-precision Adam need 16 bytes per parameter, not 12 or 14?",
              "2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master weights, Adam's m and "
              "v, 4 bytes each) = **16**."),
             ("Flash attention and selective recompute: why do they save the same memory?",
              "Both drop the **s × s attention scores** from what a layer keeps, and recompute "
              "them in backward from q, k (and a log-sum-exp per row)."),
             ("A 7B model (L = 32, h = 4096, s = 4096) trains at 60,000 tokens/s on 8 H100s "
              "of 989 TFLOP/s (bf16) each. What is its MFU?",
              "6·7·10⁹ + 12·32·4096·4096 ≈ 48.4 GFLOP per token; × 60,000 / (8 × 989·10¹²) "
              "≈ **37%**."),
         )),
    Step("03_data_parallel", "Data parallel", "about 35 min of slides, then the lab (2–3 h)",
         needs=("Lab 01: all-reduce and its 2(N−1)/N·S bytes per rank",
                "Lab 02: FLOPs per token, and when a transfer hides under compute"),
         objectives=(
             "Average gradients across ranks three ways: an all-reduce per tensor, one flat "
             "buffer, buckets launched during backward.",
             "Predict and count the bytes each rank sends per step, and derive the fewest "
             "tokens per GPU for which the all-reduce can hide under backward.",
             "Show on a timeline that bucketed all-reduces overlap backward, and explain why "
             "buckets fill in reverse order.",
             "Accumulate gradients with `no_sync()`, reshuffle with "
             "`DistributedSampler.set_epoch`, and derive the learning rate a bigger batch needs.",
         ),
         gate=(
             ("Why does data parallelism send the same bytes per step whatever the batch "
              "size?",
              "It all-reduces the **gradients**: Ψ values per step, however many samples "
              "produced them."),
             ("Why can one flat all-reduce after backward never overlap backward?",
              "It needs every gradient, and the last one exists only when backward ends; a "
              "bucket starts as soon as it is full."),
             ("You forget `sampler.set_epoch(epoch)`. What goes wrong?",
              "Every epoch sees the **same order** of samples: the sampler's shuffle is seeded "
              "by the epoch."),
         )),
    Step("04_zero_fsdp", "ZeRO and FSDP", "about 45 min of slides, then the lab (2–3 h)",
         needs=("Lab 01: reduce-scatter and all-gather",
                "Lab 02: 16 bytes per parameter",
                "Lab 03: DDP's gradient all-reduce and its buckets"),
         objectives=(
             "Shard the optimizer state (ZeRO-1), then the gradients (ZeRO-2), then the "
             "parameters (FSDP), and predict, then measure, what each holds and sends per rank.",
             "Build FSDP's loop over units: gather before forward and backward, free, "
             "reduce-scatter into the shard, prefetch the next unit asynchronously.",
             "Explain why ZeRO-1 and ZeRO-2 send what DDP sends (2Ψ) and ZeRO-3 half as much "
             "again (3Ψ), and derive when prefetch hides FSDP's gathers.",
         ),
         gate=(
             ("Ψ = 7.5B parameters on N = 64 ranks: model state per rank under ZeRO-1, ZeRO-2 "
              "and ZeRO-3?",
              "4Ψ + 12Ψ/N ≈ **31.4 GB**; 2Ψ + 14Ψ/N ≈ **16.6 GB**; 16Ψ/N ≈ **1.9 GB**, "
              "against 120 GB on every rank without ZeRO."),
             ("Why do ZeRO-1 and ZeRO-2 cost no more communication than DDP?",
              "DDP's all-reduce already is a reduce-scatter then an all-gather: ZeRO steps the "
              "optimizer on the reduced shard in between, then all-gathers the updated "
              "parameters."),
             ("With prefetching, how many units are gathered at most, and what does it hide?",
              "**Two**: the unit computing and the next one arriving. It hides each gather "
              "that is shorter than the compute of the unit before it."),
         )),
    Step("05_tensor_parallel", "Tensor parallel", "about 35 min of slides, then the lab (2–3 h)",
         needs=("Lab 01: all-reduce, reduce-scatter and all-gather",
                "Lab 02: activation memory per layer (Korthikanti's formula)",
                "`torch.autograd.Function`: a forward and a backward of your own"),
         objectives=(
             "Split a linear layer by its outputs (column) or its inputs (row), and say what "
             "communication each split needs.",
             "Write Megatron's f and g, build the parallel MLP and attention by heads, and count "
             "a block's collectives against your prediction.",
             "Compute cross-entropy over a vocabulary split across ranks without gathering the "
             "logits, and weigh a layer's messages against its matmuls.",
             "Write sequence parallelism's g and ḡ, and predict, then measure, what a rank "
             "keeps and sends with it.",
         ),
         gate=(
             ("Why is the MLP column-parallel first and row-parallel second, not the other way "
              "round?",
              "The column layer's output slice is exactly the row layer's input slice, and "
              "GeLU works on the slice: nothing is sent between the two matmuls, one "
              "all-reduce at the end."),
             ("b = 1, s = 4096, h = 4096 in bf16, t = 8: bytes in each TP all-reduce, and "
              "bytes each rank sends for it on a ring?",
              "b·s·h = 16.8M elements = **33.5 MB**; each rank sends 2·7/8 × 33.5 ≈ "
              "**58.7 MB** for it."),
             ("Why does tensor parallelism stay inside a node while data parallelism crosses "
              "nodes?",
              "TP's collectives sit **between** matmuls, on the critical path of every layer; "
              "DP's gradient all-reduce hides under backward."),
         )),
    Step("06_pipeline", "Pipeline parallel", "about 40 min of slides, then the lab (3 h)",
         needs=("Lab 00: `send`, `recv` and deadlocks",
                "Lab 03: accumulating gradients over microbatches",
                "Lab 05: a transformer layer's matmuls"),
         objectives=(
             "Write pipeline schedules as data (1F1B, interleaved), and check them with a "
             "validator and a simulator.",
             "Derive GPipe's bubble two ways, of total time and relative to the ideal time, and "
             "say which one a published figure is.",
             "Run a real send/recv pipeline with your own executor, and weigh a stage's sends "
             "against its compute.",
             "Predict, then measure, what 1F1B, interleaved and zero-bubble schedules change in "
             "time and in memory.",
         ),
         gate=(
             ("p = 4 stages, m = 8 microbatches: the bubble as a share of total time?",
              "(p−1)/(m+p−1) = 3/11 ≈ **27.3%**, not 8%; relative to the ideal time it is "
              "3/8."),
             ("What does splitting the backward into B and W let a zero-bubble schedule do?",
              "Run each **W later**, in the gaps where the rank would idle: nothing upstream waits "
              "for W, only the optimizer step."),
             ("Why is the pipeline the parallelism that crosses nodes?",
              "Each stage boundary carries only b·s·h per microbatch, point to point, against a "
              "stage's matmuls; tensor parallelism runs collectives of that size inside every "
              "layer."),
         )),
    Step("07_3d_parallel", "3D parallel and experts", "about 40 min of slides, then the lab (3 h)",
         needs=("Lab 03: data parallel", "Lab 05: tensor parallel",
                "Lab 06: pipeline parallel"),
         objectives=(
             "Number ranks on a device mesh and build every group of each dimension, checked "
             "against `init_device_mesh`.",
             "Wire one dp·pp·tp training step from Labs 03, 05 and 06, equal to one process, "
             "and count the bytes of each mesh dimension.",
             "Dispatch tokens to experts with all-to-all, and compute an expert's capacity.",
             "Write a planner's cost function from Labs 02–06, and predict the layout it picks "
             "for a 70B model on 64 GPUs.",
         ),
         gate=(
             ("`Mesh(pp=2, dp=2, tp=4)`, TP varying fastest: which ranks are in rank 5's TP, "
              "DP and PP groups?",
              "Rank 5 is pp 0, dp 1, tp 1: TP **[4, 5, 6, 7]**, DP **[1, 5]**, PP **[5, 13]**."),
             ("Why must every rank create every group, even those it is not in?",
              "`new_group` is collective over the whole job: every rank calls it, in the same "
              "order, for every group."),
             ("Why does expert parallelism use all-to-all rather than all-reduce?",
              "Each token goes to the rank that holds its expert and comes back: ranks "
              "exchange **different** data, sized by the router at run time, and nothing is "
              "summed."),
         )),
    Step("08_profiling", "Profiling, MFU and scaling", "about 35 min of slides, then the lab (2 h)",
         needs=("Lab 02: FLOPs per token and MFU",
                "Lab 03: DDP's buckets and their overlap with backward",
                "Lab 04: FSDP's prefetch", "Lab 06: pipeline bubbles"),
         objectives=(
             "Profile every rank, merge them into one timeline, and measure each rank's "
             "compute, communication, idle time and overlap fraction.",
             "Compute MFU and HFU from a throughput and a measured peak, and say which one a "
             "published number is.",
             "Predict strong and weak scaling with the α-β model, and compare with "
             "measurements.",
             "Find a straggler, catch a hang, and write the fingerprint check that catches a "
             "mismatched collective.",
         ),
         gate=(
             ("Megatron reported 52% on 3072 A100s for a 1T-parameter model. MFU or HFU?",
              "**HFU**: it counts recomputed FLOPs. Published MFU: PaLM 540B 46.2%, Llama 3 "
              "405B 38–43%."),
             ("A fixed global batch takes 80 s on 1 rank and 12 s on 8. Strong scaling "
              "efficiency?",
              "T₁ / (N·Tₙ) = 80 / (8·12) ≈ **83%**."),
             ("The overlap fraction rises from 0 to 0.6 on your laptop, but the step is no "
              "faster. Why?",
              "Hiding needs a second engine. On 2 CPU cores gloo's thread takes a core from "
              "compute; on a GPU cluster the network card and NCCL move the bytes."),
         )),
    Step("09_fault_tolerance", "Fault tolerance", "about 35 min of slides, then the lab (2 h)",
         needs=("Lab 03: DDP and `DistributedSampler`",
                "Lab 04: optimizer state sharded over ranks"),
         objectives=(
             "Size a checkpoint from what the next step cannot recompute, and derive its "
             "interval (Young, Daly) and the work failures cost.",
             "Write a sharded checkpoint that is atomic (per-rank files, metadata, a COMPLETE "
             "marker) and loads onto a different number of ranks.",
             "Restore RNG and sampler state so a resumed run is the same bit for bit, and make "
             "every rank agree to skip a step with a NaN.",
         ),
         gate=(
             ("Why write a COMPLETE marker last instead of trusting that the files exist?",
              "A crash in the middle of a save leaves some shards written: without the "
              "marker, a restart would load a torn checkpoint."),
             ("Writing a checkpoint takes δ = 1 min, and a failure comes every M = 8 h. How "
              "often do you checkpoint?",
              "√(2 · 1 · 480) ≈ **31 min** (Young); Daly's refinement subtracts δ: about "
              "30 min."),
             ("Does `torchrun --max-restarts=3` resume training where it stopped?",
              "**No**: it restarts every local worker; the script must load its own "
              "checkpoint."),
         )),
    Step("10_beyond_allreduce", "Beyond all-reduce", "about 35 min of slides, then the lab (2 h)",
         needs=("Lab 01: the ring's bytes and the α-β model",
                "Lab 03: DDP and its buckets",
                "Lab 05: the all-gather before a column-parallel layer (sequence parallel)"),
         objectives=(
             "Build a parameter server from `send` and `recv` (synchronous, asynchronous, "
             "sharded), and predict, then count, the bytes on its links against a ring rank's.",
             "Compress gradients inside DDP with top-k and PowerSGD, with error feedback, and "
             "count the bytes saved.",
             "Cut tensor parallelism's all-gather into ring steps that overlap the matmul, "
             "and see it in a profiler trace.",
         ),
         gate=(
             ("Top-k with error feedback: what does the sum of everything sent, plus the current "
              "residual, equal?",
              "The **sum of all the gradients** so far: nothing is lost, only delayed."),
             ("PowerSGD with rank r = 2 on a 1024 × 4096 gradient: how many elements are "
              "all-reduced?",
              "(1024 + 4096)·2 = **10,240**, instead of 4,194,304: about 400 times fewer."),
             ("Does asynchronous tensor parallelism send fewer bytes?",
              "**No**, the same as the all-gather; only *when* they move changes, so the "
              "transfers hide behind the matmuls."),
         )),
    Step("11_nodes_and_links", "Nodes and links", "about 30 min of slides, then the lab (2 h)",
         needs=("Lab 01: ring all-reduce, the α-β model and `auto`",
                "Lab 04: FSDP", "Lab 05: tensor parallel", "Lab 07: device meshes"),
         objectives=(
             "Fit α and β for each tier of a two-tier network, and see why a flat ring runs "
             "at its slowest link.",
             "Build a hierarchical all-reduce from the ring's pieces, and count its bytes on "
             "each tier.",
             "Place tensor parallelism and FSDP against HSDP on the tiers, and find a degraded "
             "link with a pairwise sweep.",
         ),
         gate=(
             ("NVLink 4 against InfiniBand NDR: how much faster per GPU and direction?",
              "450 GB/s each way (900 GB/s both ways together) against 50 GB/s: **9 times**."),
             ("2 nodes of 4 GPUs all-reduce S = 1 GB. Bytes each GPU sends across nodes with "
              "the hierarchical all-reduce, and each GPU's bytes on a flat ring?",
              "Hierarchical: 2·(1/2)·S/4 = **0.25 GB**. Flat ring: 2·(7/8)·S = **1.75 GB**, "
              "each step as slow as its inter-node link."),
             ("HSDP: which collectives cross nodes?",
              "Only the reduction of each gradient shard across the replicas; the parameters' "
              "all-gathers stay inside the node."),
         )),
    Step("12_memory_beyond_the_gpu", "Memory beyond the GPU",
         "about 40 min of slides, then the lab (2 h)",
         needs=("Lab 01: the α-β model, here for PCIe and disks",
                "Lab 02: 16 bytes per parameter and where they live",
                "Lab 04: ZeRO's shards and FSDP2's `fully_shard`"),
         objectives=(
             "Offload as ZeRO-Offload does: gradient slices to the host during backward, AdamW "
             "on the host, parameters back; count the bytes each way.",
             "Predict a step's time from PCIe, CPU and disk rates, and say when offloading or "
             "an NVMe tier pays.",
             "Map FSDP1 onto FSDP2, initialise a sharded model from the meta device, and clip "
             "the gradients of sharded and tp·pp models.",
         ),
         gate=(
             ("ZeRO-Offload: what stays on the GPU, and what does the CPU do?",
              "The bf16 parameters (2Ψ). Gradients go to the host as they are reduced; the CPU "
              "runs Adam on the fp32 master weights, m and v (12Ψ) and sends the updated "
              "parameters back."),
             ("7B parameters, ZeRO-Offload on one GPU over PCIe Gen5 x16 (about 64 GB/s each "
              "way): how long do the gradients take to reach the host?",
              "2Ψ = 14 GB at 64 GB/s ≈ **0.22 s**, hidden if backward takes longer."),
             ("Clipping a sharded model's gradients: what is the global norm, and how many "
              "all-reduces does it take?",
              "√(Σ over all shards of ‖g‖²): **one** all-reduce (sum) of the squared local "
              "norms."),
         )),
    Step("13_long_context", "Long context", "about 35 min of slides, then the lab (2 h)",
         needs=("Lab 01: ring steps from `send` and `recv`",
                "Lab 02: activation memory and how it grows with s",
                "Lab 05: attention split by heads", "Lab 07: device meshes"),
         objectives=(
             "Predict activations at long sequences, and why splitting the sequence (context "
             "parallelism) is needed on top of tensor parallelism.",
             "Merge partial attention results with the online softmax, and write ring "
             "attention's forward and backward with their transfers overlapping compute.",
             "Even out causal work with the zigzag split, and compare ring attention with "
             "DeepSpeed-Ulysses' all-to-alls in bytes, heads and time.",
         ),
         gate=(
             ("Zigzag split with cp = 4: which sequence chunks does rank 1 hold?",
              "The sequence is cut into 2·cp = 8 chunks; rank r holds r and 2cp−1−r: chunks "
              "**1 and 6**."),
             ("Why does Ulysses need the number of heads divisible by cp?",
              "After its all-to-all each rank attends over the **whole sequence** for whole "
              "heads: the heads are what it splits."),
             ("Merging two blocks' attention outputs: why keep each row's running max and "
              "log-sum-exp, not only the outputs?",
              "Each block's softmax was normalised by its own sum; rescaling by those makes "
              "the merge exact, as if the scores were one row."),
         )),
    Step("14_capstone", "The capstone", "about 30 min of slides, then the lab (3–4 h)",
         needs=("Lab 03: averaging gradients over replicas",
                "Lab 05: f, g and the parallel MLP and attention",
                "Lab 06: 1F1B and the send/recv executor",
                "Lab 07: mesh groups, bytes per dimension and the layout's cost",
                "Lab 08: merged profiles, overlap and MFU",
                "Lab 09: sharded checkpoints, generator capture and the NaN guard",
                "Lab 11: the emulated two-tier network"),
         objectives=(
             "Compose a dp·pp·tp training job from your own pieces, each on its mesh group, and "
             "show it equal to one process.",
             "Checkpoint it so that any layout can resume, survive a kill in the middle of a "
             "save, and resume bit for bit.",
             "Predict its bytes per dimension and its layout's step time, then count and "
             "measure them; profile a step.",
             "Find the piece at fault in a composed job with the course's tools.",
         ),
         gate=(
             ("A composed job prints plausible losses that differ from one process's. Where "
              "do you start?",
              "Swap one of your pieces for minidist's at a time: the swap that restores "
              "equality **names the piece**."),
             ("Why must a sharded checkpoint write each element from exactly one rank?",
              "So that the saved ranges tile each tensor: any layout can then compute and read "
              "its own range, and replicas do not write the same bytes twice."),
         )),
)

NEEDS_LAB = re.compile(r"^Lab (\d\d): ")


def _field(markdown: str, name: str, deck: str) -> str:
    found = re.search(rf"^\*\*{name}:\*\* (.+)$", markdown, re.MULTILINE)
    if found is None:
        sys.exit(f"slides/{deck}.md has no `**{name}:** ...` line on its title slide; the "
                 "index needs it")
    return found[1]


def _check_path(decks: dict[str, str]) -> None:
    """Exit naming the fix where PATH and the decks disagree or a step is incomplete."""
    steps = {step.lab: step for step in PATH}
    if [step.lab for step in PATH] != sorted(steps):
        sys.exit("slides/build.py: PATH lists a lab twice or out of order")
    if unlisted := sorted(decks.keys() - steps.keys()):
        sys.exit(f"slides/{unlisted[0]}.md has no step in PATH (slides/build.py): add its "
                 "prerequisites, objectives and self-check there")
    for step in PATH:
        where = f"PATH's step {step.lab} (slides/build.py)"
        if not (step.needs and 2 <= len(step.objectives) <= 4 and 2 <= len(step.gate) <= 3):
            sys.exit(f"{where} needs prerequisites, 2-4 objectives and 2-3 self-check "
                     f"questions; it has {len(step.needs)}, {len(step.objectives)} and "
                     f"{len(step.gate)}")
        for need in step.needs:
            lab = NEEDS_LAB.match(need)
            if lab and not any(other[:2] == lab[1] and other < step.lab for other in steps):
                sys.exit(f"{where} needs {need!r}, but no earlier lab is numbered {lab[1]}")
        if step.lab in decks:
            markdown = decks[step.lab]
            said = (_title(markdown), _field(markdown, "Time", step.lab))
            meant = (f"Lab {step.lab[:2]} — {step.title}", step.time)
            if said != meant:
                sys.exit(f"slides/{step.lab}.md says {said} but {where} says {meant}: make "
                         "them agree")


def _inline(text: str) -> str:
    return _markdown_inline(text).strip().removeprefix("<p>").removesuffix("</p>")


def _step(step: Step, markdown: str | None) -> str:
    """One lab of the path: what it covers, its time, deck and copy, what it needs, what it
    teaches, and the questions to answer before the next."""
    number = step.lab[:2]
    copy = f"my-labs/{step.lab}/{step.lab}.ipynb"
    if markdown is None:
        deck = '<span class="coming">deck coming</span>'
    else:
        deck = (f'<a href="{step.lab}.html">the slides</a> (PDF: '
                f"<code>slides/pdf/{step.lab}.pdf</code>)")
    if (SLIDES.parent / "labs" / step.lab / f"{step.lab}.ipynb").exists():
        work = (f'<a href="../{copy}"><code>{copy}</code></a>, your copy (it appears after '
                f"<code>make lab</code>); grade it with <code>make grade LAB={number}</code>")
    else:
        work = (f'<span class="coming">lab coming</span>: <code>make update</code> will copy '
                f"it to <code>{copy}</code>")
    needs = []
    for need in step.needs:
        lab = NEEDS_LAB.match(need)
        text = _inline(need[lab.end():] if lab else need)
        needs.append(f'<a href="#lab-{lab[1]}">Lab {lab[1]}</a>: {text}' if lab else text)
    covers = (f'<p class="covers">{_inline(_field(markdown, "Covers", step.lab))}</p>\n'
              if markdown is not None else "")
    gate = "\n".join(
        f"<li><p>{_inline(question)}</p>\n<details><summary>Answer</summary>"
        f"<p>{_inline(answer)}</p></details></li>" for question, answer in step.gate)
    return (
        f'<section class="lab" id="lab-{number}">\n'
        f"<h2>Lab {number} — {html.escape(step.title)}</h2>\n{covers}"
        f'<p class="meta">Time: {html.escape(step.time)} · Deck: {deck}</p>\n'
        f'<p class="meta">Lab: {work}</p>\n'
        "<h3>Before you start</h3>\n<ul class=\"prerequisites\">\n"
        + "\n".join(f"<li>{need}</li>" for need in needs) + "\n</ul>\n"
        "<h3>You will be able to</h3>\n<ul class=\"objectives\">\n"
        + "\n".join(f"<li>{_inline(goal)}</li>" for goal in step.objectives) + "\n</ul>\n"
        f"<h3>After Lab {number}: self-check, answer these before the next lab</h3>\n"
        "<ol class=\"self-check\">\n"
        f"{gate}\n</ol>\n</section>"
    )


def index(decks: dict[str, str]) -> str:
    """slides/index.html: the self-study path, every lab of PATH in order."""
    _check_path(decks)
    contents = " · ".join(f'<a href="#lab-{step.lab[:2]}">{step.lab[:2]} '
                          f"{html.escape(step.title)}</a>" for step in PATH)
    steps = "\n".join(_step(step, decks.get(step.lab)) for step in PATH)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Scaling Lab: self-study path</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
  color: #1b1b1b; line-height: 1.5; }}
h1 {{ color: #16324f; }} h2 {{ font-size: 1.25rem; margin: 0 0 0.3rem; color: #16324f; }}
h3 {{ font-size: 1rem; margin: 0.8rem 0 0.2rem; }} p {{ margin: 0.3rem 0; }}
ul, ol {{ padding-left: 1.4rem; margin: 0.2rem 0; }} li {{ margin-bottom: 0.3rem; }}
.lab {{ border-top: 1px solid #ccd; padding: 1.2rem 0 0.6rem; }}
.meta {{ color: #555; font-size: 0.92rem; margin: 0.2rem 0; }}
.coming {{ color: #8a5a00; font-style: italic; }}
details {{ margin: 0.1rem 0 0.5rem; }} summary {{ cursor: pointer; color: #16324f; }}
details p {{ background: #f3f5f8; padding: 0.3rem 0.6rem; border-radius: 4px; }}
kbd {{ border: 1px solid #aaa; border-radius: 3px; padding: 0 0.3em; font-size: 0.85em; }}
</style>
</head>
<body>
<h1>Scaling Lab: the self-study path</h1>
<p>{len(PATH)} labs, in order; each builds on the ones it names under "Before you start". For
each lab:</p>
<ol>
<li>Check that you have what it needs; follow a link back if not.</li>
<li>Read its deck. Every slide has the lecturer's narration (press <kbd>S</kbd> for the speaker
view, or read it under each slide in the PDF); answer the deck's "check yourself" slide before
turning the page.</li>
<li>Do the lab in your own copy. <code>make lab</code> copies every lab into
<code>my-labs/</code> the first time (the copies appear only then) and opens JupyterLab there;
the labs check your code.</li>
<li>After the lab, answer its self-check questions on paper before you open an answer: they
review what the lab had you work out, so leave them until you have done it. Any you miss: go back
to its deck or lab before moving on.</li>
<li>Grade your lab: <code>make grade LAB=NN</code> (its number, e.g. <code>LAB=03</code>) runs
the grader's hidden tests on your copy, in a scratch copy that leaves <code>my-labs/</code> as it
is, and prints each graded cell's points and, for a failed one, the check's message. Fix and
regrade until it gives full marks.</li>
</ol>
<p>Keys: <kbd>→</kbd>/<kbd>←</kbd> move, <kbd>Esc</kbd> overview, <kbd>S</kbd> speaker notes,
<kbd>Ctrl</kbd>+<kbd>Shift</kbd>+<kbd>F</kbd> search. Every deck is one file that works
offline. PDFs (one slide per page, notes under it) are built into <code>slides/pdf/</code> by
<code>.venv/bin/python slides/build.py</code> when Chromium is installed; or open a deck with
<code>?print-pdf</code> and print it. A lab whose deck is not published yet says "deck coming";
<code>make update</code> brings new decks and labs.</p>
<p>Sources: <a href="../REFERENCES.md"><code>REFERENCES.md</code></a> lists every paper, standard
and documentation page the decks and labs rely on, with the section or table each fact comes
from; the citations on the slides link to it.</p>
<p class="meta">Labs: {contents}</p>
{steps}
</body>
</html>
"""


# --- Printing, in the system's Chromium ------------------------------------------------------

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# A headless Chromium that contacts nobody by itself (and runs as root in CI containers).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-default-apps", "--disable-extensions", "--hide-scrollbars",
                 "--mute-audio", "--disable-dev-shm-usage"]
WIDTH, HEIGHT = 1280, 720


def find_chromium() -> str | None:
    """The path of an installed Chromium (or Chrome), or None."""
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


@contextlib.contextmanager
def chromium(path: str):
    """A headless Chromium (a Playwright Browser) started from `path`, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def print_deck(browser, deck: Path) -> bytes:
    """A reveal.js deck printed to PDF (opened with ?print-pdf, once reveal has laid out its
    pages): one page per slide, with the speaker notes under the slide."""
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    try:
        page.goto(deck.resolve().as_uri() + "?print-pdf")
        page.wait_for_function("document.querySelectorAll('.pdf-page').length > 0 && "
                               "document.querySelectorAll('.pdf-page').length === "
                               "document.querySelectorAll('.slides section').length")
        cut = page.evaluate("[...document.querySelectorAll('.pdf-page')].map((p, i) => "
                            "[i + 1, p.querySelector('.speaker-notes-pdf')]).filter(([, n]) => "
                            "n && n.scrollHeight > n.clientHeight + 1).map(([i]) => i)")
        if cut:
            raise ValueError(f"{deck.name}: the notes of slides {cut} do not fit under the slide "
                             "when printed; shorten them")
        return page.pdf(prefer_css_page_size=True, print_background=True)
    finally:
        page.close()


# --- Main ----------------------------------------------------------------------------------------


def build() -> dict[Path, str]:
    """Every output file and its text: the decks and the index."""
    head, scripts = assets()
    sources = {path.stem: path.read_text() for path in sorted(SLIDES.glob("[0-9][0-9]_*.md"))}
    built = {SLIDES / f"{name}.html": render(markdown, head, scripts)
             for name, markdown in sources.items()}
    built[SLIDES / "index.html"] = index(sources)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed decks")
    args = parser.parse_args()
    built = build()
    if args.check:
        stale = [path.name for path, text in built.items() if not path.exists()
                 or _without_pixels(path.read_text()) != _without_pixels(text)]
        if stale:
            sys.exit(f"out of date: {', '.join(stale)}; rebuild with: "
                     ".venv/bin/python slides/build.py")
        return
    for path, text in built.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(SLIDES.parent)}")
    path = find_chromium()
    if path is None:
        print("no Chromium found: PDFs not built (install the `chromium` package for them)")
        return
    PDF_DIR.mkdir(exist_ok=True)
    with chromium(path) as browser:
        for deck in built:
            if deck.name != "index.html":
                pdf = PDF_DIR / deck.with_suffix(".pdf").name
                pdf.write_bytes(print_deck(browser, deck))
                print(f"wrote {pdf.relative_to(SLIDES.parent)}")


if __name__ == "__main__":
    main()
