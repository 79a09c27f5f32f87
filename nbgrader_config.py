"""nbgrader configuration for Scaling Lab (instructor workflow: solutions/README.md).

nbgrader loads this file from the current directory and from the course root, so every
`nbgrader` command works from the repo root without flags. Paths derive from this file's own
location: a copy of the repo (as the tests make) is a course of its own.
"""

import os
import sys
from pathlib import Path

import nbgrader
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.converters import Autograde
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import ClearSolutions, Execute, GetGrades

c = get_config()  # noqa: F821  (injected by traitlets when it loads this file)

ROOT = Path(__file__).resolve().parent
# The course's grading tooling (tools/grading/) is instructors' only: it is not in the student
# release, nor in the minidist library students install.
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from grading.export import GradesCsv  # noqa: E402
from grading.feedback import (  # noqa: E402
    FEEDBACK_TEMPLATE,
    TEMPLATES,
    HideHiddenTests,
    MathToMathML,
)
from grading.predictions import KeepPredictionRecords, RestorePredictionLedger  # noqa: E402
from grading.stubs import name_unwritten_exercises  # noqa: E402
from grading.timeouts import announce_timeouts  # noqa: E402

from minidist.core.predictions import LEDGER_NAME  # noqa: E402

# Instructor notebooks live in solutions/<lab>/<lab>.ipynb; `nbgrader generate_assignment`
# writes the student versions to labs/<lab>/<lab>.ipynb, which students get from git. The
# gradebook is <root>/gradebook.db (nbgrader's default, so it follows --CourseDirectory.root).
c.CourseDirectory.root = str(ROOT)
c.CourseDirectory.course_id = "scaling-lab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"

# nbgrader's gradebook shells out to `alembic`: find it next to this Python, so that
# `.venv/bin/nbgrader` works without activating the venv.
VENV_BIN = str(Path(sys.executable).parent)
# (A JupyterLab started by JupyterHub's SlurmSpawner may have no PATH at all.)
PATH = os.environ.get("PATH", os.defpath)
if VENV_BIN not in PATH.split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join([VENV_BIN, PATH])

# Grading runs students' code: a cell that hangs is interrupted after CELL_TIMEOUT_S and scores
# 0, and the rest of the notebook still runs. minidist's own timeout is set below the cell's,
# so a deadlocked multi-rank call fails first with RankTimeout, whose message says which ranks
# were stuck where (the cell interrupt would still kill the ranks, but say less).
CELL_TIMEOUT_S = 60
c.Execute.timeout = CELL_TIMEOUT_S
c.Execute.interrupt_on_timeout = True
# After a cell's reply, nbclient waits for the rest of its output; nbgrader makes a wait past
# `iopub_timeout` (4 s by default) fail the whole notebook's grading. A busy grading machine
# can take that long to deliver a figure or a widget, so the wait is bounded higher.
c.Execute.iopub_timeout = 30
os.environ.setdefault("MINIDIST_TIMEOUT", str(CELL_TIMEOUT_S // 2))
# A cell stopped at the limit says so in its output, which the student's feedback shows.
announce_timeouts(Execute)

# Predictions are graded as first committed (minidist.core.predictions): the history each prediction
# cell and measurement cell showed is kept before autograde clears the outputs, and written as
# the ledger that the notebook's run reads. A ledger is never copied as a course file: an
# instructor's own run of a solution must not become every student's history.
NBGRADER_DEFAULTS = {**Autograde.class_traits(), **CourseDirectory.class_traits()}
c.Autograde.sanitize_preprocessors = [
    KeepPredictionRecords, *NBGRADER_DEFAULTS["sanitize_preprocessors"].default()
]
c.Autograde.autograde_preprocessors = [
    RestorePredictionLedger, *NBGRADER_DEFAULTS["autograde_preprocessors"].default()
]
c.CourseDirectory.ignore = [*NBGRADER_DEFAULTS["ignore"].default(), LEDGER_NAME]

# A student's stub names its exercise and says how to run the cells below it (tools/grading/
# stubs.py), right after nbgrader clears the solutions and before it checksums the cells.
# GenerateAssignment's list of steps is not a config option, so the naming joins the clearing.
name_unwritten_exercises(ClearSolutions)

# Feedback goes to students: strip the hidden tests that autograding put back into the
# test cells, and the tracebacks that quote them. Its math is MathML and its template loads
# no script, so it reads the same offline.
c.GenerateFeedback.preprocessors = [
    GetGrades, HideHiddenTests, MathToMathML, CSSHTMLHeaderPreprocessor
]
NBGRADER_TEMPLATES = (
    Path(nbgrader.__file__).parent / "server_extensions" / "formgrader" / "templates"
)
c.HTMLExporter.template_name = FEEDBACK_TEMPLATE
c.HTMLExporter.extra_template_basedirs = [str(TEMPLATES), str(NBGRADER_TEMPLATES)]

# grades.csv says "not submitted" where nbgrader's own export would write 0.
c.ExportApp.plugin_class = GradesCsv
