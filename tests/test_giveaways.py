"""Nothing answered before it is asked (issue 40): no REFERENCES.md entry, no deck before its
"After Lab NN" part and no docstring of the minidist code a lab's exercise rebuilds states the
answer of a graded question.

The graded questions are the nbgrader solution cells of solutions/NN_topic/NN_topic.ipynb that
assign `prediction_*` or `answer_*`. For each one the test derives, from the solution's source
alone (no notebook runs):

- its **values**: the numbers written in the assignment and, where the expression is plain
  arithmetic on numbers (and on names the same cell set that way), the value it evaluates to,
  each of a dict, list or tuple; then every form prose writes a number in: "0.75", "75%", "3/4",
  "1,024", "2 MiB", "840 GB", "1.88·10⁹", rounded to 2–4 significant digits;
- its **topic words**: the words of the variable's name (`prediction_naive_idle`: naive, idle),
  matched by their first five letters ("idles", "idle");
- its **formulas** (`FORMULAS` below): the forms no evaluation yields, the answer in words or
  in the course's notation (2(N−1)/N, (p−1)/(m+p−1), 16Ψ/N, "p microbatches").

A value is a hit where it stands in the same paragraph (or table row, bullet, slide line block)
as one of the question's topic words; a formula is a hit wherever it stands. Values too common to
mean anything are left out: whole numbers up to 8, 10, 100 and 1000 (`TOO_COMMON`), and any number
the lab itself prints before it asks (the lab gave it, so a page repeating it gives nothing away).
Strings (a letter, "nccl", "microbatch") are left out too: they are the question's own words.

Where it looks, for a question of Lab L:

- REFERENCES.md, all of it (the release ships it from Lab 00 on);
- the decks of labs before L, all of them, and deck L up to its first "## After Lab L" slide
  (decks ask, then answer after that marker; later decks come after the lab);
- the docstrings (module, class and function) of minidist's functions and classes that carry the
  name of a function or class L's exercises define (`my_` dropped), and of `REBUILT` below.

A hit names the lab, the question, the file and the line. `ALLOWED` lists the hits that are
not answers, each with its reason.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "REFERENCES.md"
SLIDES = REPO / "slides"
MINIDIST = REPO / "lib" / "minidist"
NOTEBOOKS = sorted((REPO / "solutions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))

# Whole numbers every page uses for something else (ranks, bytes of a dtype, a percent's base).
# 12 is Adam's fp32 bytes per parameter, which Lab 02 teaches and every later page repeats.
TOO_COMMON = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 100, 1000}
# A rounded form stands for a value only when it is this close (relative): "3.35" for 3.3529 is
# the answer, "3.4" is another number.
ROUNDING = 1e-3
# A variable's name ending in a unit asks for the number in that unit: the unit must follow it.
UNITS = {"gb": r"\s?GB", "ms": r"\s?ms", "s": r"\s?s\b", "seconds": r"\s?(?:s\b|seconds)",
         "minutes": r"\s?min", "hours": r"\s?(?:h\b|hours)"}
# Words of a variable's name that say nothing about its topic.
GENERIC = {"answer", "prediction", "with", "without", "over", "than", "from", "each", "many",
           "much", "what", "which", "after", "before", "first", "under", "most"}

# The answers in the course's notation or in words, which no evaluation of the solution yields:
# regular expressions per question (lab, variable), each a hit wherever it stands in the places
# above. Minus signs are written "-" or "−"; LaTeX as the decks write it.
M = r"[-−]"
N_1_OVER_N = rf"\(N\s?{M}\s?1\)\s?/\s?N"
FRAC_N_1_N = rf"\\frac\{{N\s?{M}\s?1\}}\{{N\}}"
FORMULAS: dict[tuple[str, str], list[str]] = {
    # Lab 01 Q1-Q7: what a rank of the ring sends and its limit, the busbw factors, the steps.
    ("01", "answer_bytes_per_rank_gb"): [rf"2\s?{N_1_OVER_N}", rf"2\s?{FRAC_N_1_N}",
                                         rf"\\frac\{{2\(N{M}1\)\}}\{{N\}}"],
    ("01", "answer_bytes_limit_multiple"): [r"tends to 2S whatever N"],
    ("01", "answer_busbw_factor_all_reduce_8"): [
        rf"all-reduce\W+2\s?{N_1_OVER_N.replace('N', 'n')}", rf"all-reduce\W+\$?2{FRAC_N_1_N}"],
    ("01", "answer_busbw_factor_all_gather_8"): [
        rf"all-gather and reduce-scatter\W+\$?{N_1_OVER_N.replace('N', 'n')}",
        rf"all-gather and reduce-scatter,?\s+\$?{FRAC_N_1_N}"],
    ("01", "answer_rd_steps_8"): [r"recursive doubling\W+\(?log₂\s?N steps",
                                  r"recursive doubling[^\n]*\$\\log_2 N\$"],
    ("01", "answer_rabenseifner_steps_8"): [r"Rabenseifner[^\n]*2\s?\\?log", r"2 log₂N steps"],
    # Lab 04: what each stage holds and sends per rank; ZeRO-2's floor.
    ("04", "prediction_held_per_param"): [
        r"4Ψ\s?\+\s?12Ψ/N", r"2Ψ\s?\+\s?14Ψ/N", r"16Ψ/N per rank",
        r"with FSDP[^\n]*\n?[^\n]*16Ψ/\d",
        r"4\\Psi\s?\+\s?12\\Psi/N", r"2\\Psi\s?\+\s?14\\Psi/N"],
    ("04", "prediction_sent_per_param"): [r"ZeRO-3[^\n]*\*\*3Ψ\*\*", r"3Ψ on the wire",
                                          r"only ZeRO-3 moves 1\.5×", r"ZeRO-3 1\.5×"],
    ("04", "answer_zero2_floor_gb"): [r"2Ψ\s?\+\s?14Ψ/N", r"2\\Psi\s?\+\s?14\\Psi/N"],
    # Lab 05: f and g, what a block runs and reduces; what sequence parallelism does.
    ("05", "answer_mlp_forward_collectives"): [r"\*\*f\*\* is the identity forward"],
    ("05", "prediction_forward_all_reduces"): [r"two all-reduces forward", r"It is two forward"],
    ("05", "prediction_backward_all_reduces"): [r"two backward per transformer layer",
                                                r"two forward and two backward"],
    ("05", "prediction_all_reduce_elements"): [r"each of b·s·h\s+elements"],
    ("05", "prediction_sp_over_tp_bytes"): [r"all-gather, \*\*the same volume\*\*"],
    ("05", "prediction_sp_activation_fraction"): [
        r"tensor \+ sequence parallel\s+s·b·h·\(34 \+ 5·a·s/h\)/t"],
    # Lab 06: the bubble's forms, 1F1B's bubble and first stage, the interleaved bubble.
    ("06", "prediction_naive_idle"): [r"unpipelined step idles"],
    ("06", "answer_gpipe_m_for_ten_percent"): [
        rf"\(p\s?{M}\s?1\)\s?/\s?\(m\s?\+\s?p\s?{M}\s?1\)",
        rf"\\frac\{{p\s?{M}\s?1\}}\{{m\s?\+\s?p\s?{M}\s?1\}}"],
    ("06", "prediction_1f1b_over_gpipe"): [r"1F1B keeps GPipe's bubble"],
    ("06", "prediction_1f1b_first_stage_inflight"): [r"first stage still holds\s+p microbatches"],
    ("06", "prediction_interleaved_relative"): [rf"interleaved: \(p\s?{M}\s?1\)/\(v·m\)"],
    # Lab 12 Q1, Q2, Q6: whether PyTorch offloads by itself, what crosses PCIe under
    # ZeRO-Offload, whether SHARD_GRAD_OP saves memory.
    ("12", "answer_pytorch_offloads_silently"): [r"never offloads on its own",
                                                 r"It never does; out of memory"],
    ("12", "answer_pcie_gb_per_step"): [r"\(2Ψ bytes\)[^\n]*\n?[^\n]*\(2Ψ\)",
                                        r"4Ψ bytes[^\n]*PCIe", r"PCIe[^\n]*4Ψ"],
    ("12", "answer_shard_grad_op_saves_memory"): [r"less communication, more\s+memory",
                                                  r"uses more memory than `FULL_SHARD`",
                                                  r"not an out-of-memory fix"],
}

# minidist functions or classes an exercise rebuilds under another name: lab -> names.
REBUILT: dict[str, set[str]] = {
    "01": {"ring_all_reduce", "recursive_doubling_all_reduce"},
    "06": {"bubble_fraction", "one_f_one_b", "interleaved_1f1b", "zb_h1"},
}

# Hits that are not answers: (lab, variable, file, text in the line) -> why.
ALLOWED: dict[tuple[str, str, str, str], str] = {
    ("13", "answer_cp_group_of_rank_5", "slides/07_3d_parallel.md", "DP group [5, 7]"):
        "Lab 07's mesh (pp = 2, dp = 2, tp = 2), a data-parallel group: Lab 13 asks for the cp "
        "group of another mesh, which happens to hold the same ranks",
}


@dataclass
class Question:
    lab: str
    name: str
    grade_id: str
    values: list[float] = field(default_factory=list)
    sequences: list[list[float]] = field(default_factory=list)  # list answers, as a whole
    given: str = ""  # the lab's text before the question

    @property
    def unit(self) -> str:
        return UNITS.get(self.name.rsplit("_", 1)[-1], "")

    @property
    def topic(self) -> list[str]:
        words = self.name.split("_")[1:]
        return sorted({word[:5].lower() for word in words
                       if len(word) >= 3 and word.isalnum() and not word.isdigit()
                       and word.lower() not in GENERIC and word.lower() not in UNITS})


def solution_source(source: str) -> str:
    match = re.search(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.DOTALL)
    return match[1] if match else ""


def numbers_in(node: ast.AST) -> list[float]:
    return [float(sub.value) for sub in ast.walk(node)
            if isinstance(sub, ast.Constant) and type(sub.value) in (int, float)]


def flattened(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in flattened(item)]
    return []


BUILTINS = {"sum": sum, "max": max, "min": min, "len": len, "range": range, "abs": abs}


def value_of(node: ast.expr, names: dict):
    """Plain arithmetic on numbers, containers, comprehensions and `BUILTINS`, over names the
    cell set that way; None for anything else (a name of the lab, an attribute, a call)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) or (
                isinstance(sub, ast.Call) and not (isinstance(sub.func, ast.Name)
                                                   and sub.func.id in BUILTINS)):
            return None
    try:
        return eval(compile(ast.Expression(node), "<solution>", "eval"),  # noqa: S307
                    {"__builtins__": BUILTINS}, dict(names))
    except Exception:  # noqa: BLE001 - a name the cell does not set: no value
        return None


def questions() -> list[Question]:
    found = []
    for notebook in NOTEBOOKS:
        lab = notebook.name[:2]
        cells = json.loads(notebook.read_text())["cells"]
        for index, cell in enumerate(cells):
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell["cell_type"] != "code" or not meta.get("solution"):
                continue
            try:
                tree = ast.parse(solution_source("".join(cell["source"])))
            except SyntaxError:
                continue
            given = "\n".join("".join(c["source"]) for c in cells[:index]
                              if c["cell_type"] == "markdown")
            names: dict = {}
            for statement in tree.body:
                if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                        and isinstance(statement.targets[0], ast.Name)):
                    continue
                name = statement.targets[0].id
                value = value_of(statement.value, names)
                if value is not None:
                    names[name] = value
                if name.startswith(("prediction_", "answer_")):
                    # The numbers written in it count only where it cannot be evaluated: they are
                    # otherwise the question's inputs, and its value is the answer.
                    numbers = (flattened(value) if value is not None
                               else numbers_in(statement.value))
                    sequences = []
                    if isinstance(value, (list, tuple)) and len(flattened(value)) == len(value):
                        sequences, numbers = [flattened(value)], []
                    found.append(Question(lab, name, meta.get("grade_id", ""), numbers,
                                          sequences, given))
    return found


def number_patterns(value: float, unit: str = "") -> list[str]:
    """The ways prose writes `value`, as regular expressions of one token each."""
    forms: set[str] = set()
    magnitude = abs(value)
    if magnitude >= 1 and value == int(value):
        whole = int(value)
        forms |= {f"{whole}", f"{whole:,}", f"{whole:,}".replace(",", " "),
                  f"{whole:,}".replace(",", "\u202f")}
    def close(text: str, scale: float = 1.0) -> bool:
        return math.isclose(float(text) * scale, value, rel_tol=ROUNDING)

    for digits in (2, 3, 4):
        if close(text := f"{value:.{digits}g}"):
            forms.add(text)
    if 0 < magnitude < 1:
        for digits in (2, 3):
            if close(text := f"{value * 100:.{digits}g}", 0.01):
                forms.add(text + "%")
    fraction = Fraction(value).limit_denominator(64)
    if fraction.denominator > 1 and math.isclose(float(fraction), value, rel_tol=1e-9):
        forms.add(f"{fraction.numerator}/{fraction.denominator}")
    units = [(1e3, "(?:k|K|thousand)"), (1e6, "(?:M|MB|million)"), (1e9, "(?:G|GB|B|billion)"),
             (1e12, "(?:T|TB|trillion)"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB")]
    for scale, unit in units:
        scaled = value / scale
        if magnitude >= scale and scaled < 1000:
            for digits in (2, 3, 4):
                if close(text := f"{scaled:.{digits}g}", scale):
                    forms.add(text + r"\s?" + unit)
    if magnitude >= 1e4:
        exponent = int(math.floor(math.log10(magnitude)))
        mantissa = value / 10**exponent
        superscript = str(exponent).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
        for digits in (2, 3):
            if close(text := f"{mantissa:.{digits}g}", 10**exponent):
                forms.add(text + rf"\s?[·×x*]\s?10(?:{superscript}|\^\{{?{exponent}\}}?)")
                forms.add(f"{text}e{exponent}")
    patterns = []
    for form in forms:
        escaped = form if "\\" in form else re.escape(form)
        patterns.append(rf"(?<![\w.,/^{{\d]){escaped}{unit}(?![\d])(?!\.\d)(?!,\d\d\d)")
    return patterns


def sequence_patterns(values: list[float]) -> list[str]:
    """A list answer written out: "[9, 13]", "9, 13", "2048 × 1024"."""
    items = [f"{value:g}" for value in values]
    return [r"(?<![\w.])" + r"\s*,\s*".join(items) + r"(?![\d.])",
            r"(?<![\w.])" + r"\s*[×x]\s*".join(items) + r"(?![\d.])"]


def meaningful(question: Question, value: float) -> bool:
    if value == int(value) and abs(value) in TOO_COMMON:
        return False
    if any(re.search(pattern, question.given) for pattern in number_patterns(value, question.unit)):
        return False
    return True


@dataclass
class Place:
    """A text the learner can read before the question, cut into blocks (paragraphs)."""

    name: str
    text: str
    first_line: int = 1

    def blocks(self) -> list[tuple[int, str]]:
        """(first line, text) of each paragraph; a list item, table row or quoted line is a
        block of its own."""
        starts = [0] + [match.end() for match in re.finditer(
            r"\n\s*\n|\n(?=\s*(?:[-*>|]|\d+\.)\s)", self.text)]
        ends = starts[1:] + [len(self.text)]
        return [(self.first_line + self.text.count("\n", 0, start), self.text[start:end])
                for start, end in zip(starts, ends, strict=True) if self.text[start:end].strip()]


def deck_places(lab: str) -> list[Place]:
    places = []
    for deck in sorted(SLIDES.glob("[0-9][0-9]_*.md")):
        number, text = deck.name[:2], deck.read_text()
        if number > lab:
            continue
        if number == lab:
            marker = re.search(rf"^## After Lab {lab}\b", text, re.MULTILINE)
            text = text[:marker.start()] if marker else text
        places.append(Place(f"slides/{deck.name}", text))
    return places


def defined_names(lab: str) -> set[str]:
    notebook = next(path for path in NOTEBOOKS if path.name.startswith(lab))
    names = set(REBUILT.get(lab, set()))
    for cell in json.loads(notebook.read_text())["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell["cell_type"] == "code" and meta.get("solution"):
            for name in re.findall(r"^\s*(?:def|class) (\w+)", "".join(cell["source"]), re.M):
                if not name.startswith("_") and name not in {"forward", "backward"}:
                    names.add(name.removeprefix("my_"))
    return names


def docstring_places(lab: str) -> list[Place]:
    wanted, places = defined_names(lab), []
    for module in sorted(MINIDIST.rglob("*.py")):
        tree = ast.parse(module.read_text())
        name = module.relative_to(REPO).as_posix()
        matched = [node for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                   and node.name in wanted]
        if matched and (doc := ast.get_docstring(tree, clean=False)):
            places.append(Place(name, doc, tree.body[0].lineno))
        for node in matched:
            if doc := ast.get_docstring(node, clean=False):
                places.append(Place(name, doc, node.body[0].lineno))
    return places


def hits(question: Question, places: list[Place]) -> list[str]:
    found = []
    values = sorted({value for value in question.values if meaningful(question, value)})
    question.sequences = [sequence for sequence in question.sequences
                          if not any(re.search(pattern, question.given)
                                     for pattern in sequence_patterns(sequence))]
    topic = question.topic
    formulas = FORMULAS.get((question.lab, question.name), [])
    for place in places:
        for line, block in place.blocks():
            stems = {word[:5].lower() for word in re.findall(r"[A-Za-z0-9]+", block)}
            near = [word for word in topic if word in stems]
            if len(near) < min(2, len(topic)):
                near = []
            for sequence in question.sequences if near else []:
                for pattern in sequence_patterns(sequence):
                    if match := re.search(pattern, block):
                        found.append((place, line + block[:match.start()].count("\n"),
                                      f"{sequence} as {match[0]!r} beside {near}"))
            for value in values if near else []:
                for pattern in number_patterns(value, question.unit):
                    if match := re.search(pattern, block):
                        found.append((place, line + block[:match.start()].count("\n"),
                                      f"{value:g} as {match[0]!r} beside {near}"))
                        break
            for formula in formulas:
                for match in re.finditer(formula, block):
                    found.append((place, line + block[:match.start()].count("\n"),
                                  f"the formula {match[0]!r}"))
    report = []
    for place, line, what in found:
        text = place.text.splitlines()[line - place.first_line].strip()
        if any(key[:3] == (question.lab, question.name, place.name) and key[3] in text
               for key in ALLOWED):
            continue
        report.append(f"Lab {question.lab} {question.name} ({question.grade_id}): "
                      f"{place.name}:{line}: {what}: {text[:140]}")
    return report


QUESTIONS = questions()


def test_every_lab_has_graded_questions_the_test_reads():
    labs = {question.lab for question in QUESTIONS}
    missing = sorted({path.name[:2] for path in NOTEBOOKS} - labs)
    assert not missing, f"no graded prediction or answer found in labs {missing}"
    assert all(key[0] in labs for key in FORMULAS), "FORMULAS names a lab with no question"
    named = {(question.lab, question.name) for question in QUESTIONS}
    stale = sorted(set(FORMULAS) - named)
    assert not stale, f"FORMULAS names questions the solutions no longer have: {stale}"


@pytest.mark.parametrize("lab", sorted({question.lab for question in QUESTIONS}))
def test_nothing_answers_a_graded_question_before_the_lab_asks_it(lab):
    places = [Place("REFERENCES.md", REFERENCES.read_text())]
    places += deck_places(lab) + docstring_places(lab)
    report = [hit for question in QUESTIONS if question.lab == lab
              for hit in hits(question, places)]
    assert not report, (
        f"Lab {lab}: these state a graded answer before the lab asks for it; point to the source "
        "(paper, section) without the value, or move it after the deck's '## After Lab "
        f"{lab}' slide (or add to ALLOWED, with the reason):\n" + "\n".join(report))
