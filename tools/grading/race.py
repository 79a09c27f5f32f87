"""The capstone's race (Lab 14): every student's time to 95 % exact match, as a table and a plot.

    python tools/grading/race.py          # autograded/*/14_capstone/14_capstone.ipynb
    python tools/grading/race.py submitted                # <student>/14_capstone/... anywhere
    python tools/grading/race.py /srv/nbgrader/exchange/scaling-lab/inbound   # the exchange

Lab 14's race cell prints one line, `RACE {...}`: the student's committed plan (dp, pp, tp,
microbatches), the seconds their job took to reach 95 %, the steps, and whose each piece was.
Autograded notebooks all ran on the grader's machine, so their times compare fairly; those
from `submitted/` or the exchange ran on each student's own machine, and the table says so. In
the exchange's inbound folder a student may have submitted several times
(`<student>+14_capstone+<timestamp>/`): the latest counts.

Writes race.csv and race.png in the current directory and prints the table, fastest first.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

LAB = "14_capstone"
MARK = "RACE "


def race_line(notebook: Path) -> dict | None:
    """The race record a notebook printed, or None if it has none (not run, or failed)."""
    for cell in json.loads(notebook.read_text()).get("cells", []):
        for output in cell.get("outputs", []):
            text = output.get("text", "")
            text = "".join(text) if isinstance(text, list) else text
            for line in text.splitlines():
                if line.startswith(MARK):
                    return json.loads(line[len(MARK):])
    return None


def student_of(notebook: Path, root: Path) -> tuple[str, str]:
    """(student, the submission's timestamp or "") from where the notebook lies."""
    for part in notebook.relative_to(root).parts:
        if f"+{LAB}+" in part:  # the exchange: <student>+<assignment>+<timestamp>
            student, _, stamp = part.split("+", 2)
            return student, stamp
    return notebook.parent.parent.name, ""  # <student>/14_capstone/14_capstone.ipynb


def collect(root: Path) -> list[dict]:
    """One row per student: their latest notebook's race, or why there is none."""
    latest: dict[str, tuple[str, Path]] = {}
    for notebook in sorted(root.rglob(f"{LAB}.ipynb")):
        if ".ipynb_checkpoints" in notebook.parts:
            continue
        student, stamp = student_of(notebook, root)
        if student not in latest or stamp > latest[student][0]:
            latest[student] = (stamp, notebook)
    rows = []
    for student, (_, notebook) in sorted(latest.items()):
        record = race_line(notebook)
        if record is None or record.get("time_to_target") is None:
            rows.append({"student": student, "layout": "", "seconds": None, "steps": None,
                         "pieces": "", "note": "no race result in the notebook"})
            continue
        plan = record["plan"]
        # The pieces that ran in the race ("used": counted per call), else every one loaded.
        whose = record.get("whose", {})
        ran = [name for name in record.get("used", whose) if name in whose]
        mine = [name for name in ran if whose[name] == "yours"]
        rows.append({"student": student,
                     "layout": f"dp{plan['dp']}·pp{plan['pp']}·tp{plan['tp']} "
                               f"m={plan['microbatches']}",
                     "seconds": round(float(record["time_to_target"]), 2),
                     "steps": record.get("steps"), "pieces": f"{len(mine)} of "
                     f"{len(ran)} theirs" + (" (of those that ran)" if "used" in record else ""),
                     "note": ""})
    return sorted(rows, key=lambda row: (row["seconds"] is None, row["seconds"] or 0.0))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [row for row in rows if row["seconds"] is not None]
    layouts = sorted({row["layout"] for row in timed})
    colors = {layout: plt.get_cmap("tab10")(k % 10) for k, layout in enumerate(layouts)}
    fig, ax = plt.subplots(figsize=(8, 0.35 * max(len(timed), 4) + 1))
    ax.barh([row["student"] for row in timed], [row["seconds"] for row in timed],
            color=[colors[row["layout"]] for row in timed])
    ax.invert_yaxis()
    ax.set_xlabel("seconds to 95 % exact match")
    ax.set_title(title, loc="left")
    for layout, color in colors.items():
        ax.barh([], [], color=color, label=layout)
    if layouts:
        ax.legend(title="layout", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    root = Path(argv[0]) if argv else Path("autograded")
    if not root.is_dir():
        sys.exit(f"{root} is not a folder: give autograded/, submitted/ or the exchange's "
                 f"inbound folder")
    rows = collect(root)
    if not rows:  # nothing to race yet: not an error
        print(f"no {LAB}.ipynb under {root} yet: autograde {LAB} first")
        return
    where = ("on the grader's machine" if root.name == "autograded"
             else "each on the student's own machine")
    with open("race.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, Path("race.png"), f"Lab 14: time to 95 % on 4 ranks, two nodes ({where})")
    print(f"{'student':<16} {'layout':<20} {'seconds':>8} {'steps':>6}  pieces")
    for row in rows:
        seconds = f"{row['seconds']:.2f}" if row["seconds"] is not None else "-"
        print(f"{row['student']:<16} {row['layout']:<20} {seconds:>8} {row['steps'] or '-':>6}"
              f"  {row['pieces'] or row['note']}")
    print(f"times measured {where}; wrote race.csv and race.png")


if __name__ == "__main__":
    main(sys.argv[1:])
