"""A graded class on the local cluster, through JupyterHub, with nbgrader's exchange.

Two students and an instructor log in; each one's JupyterLab runs as a Slurm job. Everything
then goes through the hub's proxy as the REST calls of JupyterLab's panels: the instructor's
Formgrader generates and releases a lab, the students' Assignments panel fetches it, each
student saves their notebook (one with every answer, one untouched) and submits; Formgrader
collects, autogrades, generates and releases feedback; the students fetch their feedback. The
instructor then exports grades.csv with the nbgrader command. Students have the Assignments
panel but not Formgrader or Create Assignment, and can read neither each other's submissions
nor the instructor's course.
"""

from __future__ import annotations

import csv
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import requests
from cluster_fixtures import LocalCluster, run_ok, wait_for
from nbgrader.api import Gradebook
from test_grading import answered, read_notebook

pytestmark = [
    pytest.mark.xdist_group("cluster"),
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: creates accounts, and runs JupyterHub, which checks passwords with "
        "PAM and submits Slurm jobs as those accounts on the local cluster",
    ),
]

REPO = Path(__file__).resolve().parents[1]
HUB_SH = REPO / "cluster_setup" / "local" / "hub" / "hub.sh"
STUDENTS_GROUP = "slstudents"  # jupyterhub_students_group in cluster_setup/local/hub/inventory.yml
INSTRUCTORS_GROUP = "slinstructors"  # jupyterhub_instructors_group there
STUDENTS = ("slclass1", "slclass2")
INSTRUCTOR = "slteacher"
COURSE_ID = "scaling-lab"  # course_env_course_id, and the course's nbgrader_config.py
COURSE_DIR = "scaling-lab"  # course_env_instructor_course: the instructor's ~/scaling-lab
LAB = "02_memory_math"  # no ranks: quick to grade inside a one-core job



def as_user(user: str, *command: str) -> subprocess.CompletedProcess:
    """Run a command as `user`, without raising on failure (the isolation checks expect some)."""
    return subprocess.run(["runuser", "-u", user, "--", *command], capture_output=True,
                          text=True, timeout=60)



def user_pids(user: str) -> list[int]:
    found = subprocess.run(["pgrep", "--uid", user], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, str]]:
    """Two students and an instructor with fresh passwords and private home directories. Afterwards
    their processes are killed, and the accounts and groups this fixture made are removed."""
    made_groups = []
    for group in (STUDENTS_GROUP, INSTRUCTORS_GROUP):
        if subprocess.run(["getent", "group", group], capture_output=True).returncode != 0:
            run_ok("groupadd", group)
            made_groups.append(group)
    made_users = []
    passwords = {}
    for user, group in [*((s, STUDENTS_GROUP) for s in STUDENTS), (INSTRUCTOR, INSTRUCTORS_GROUP)]:
        if subprocess.run(["id", user], capture_output=True).returncode != 0:
            run_ok("useradd", "--create-home", "--shell", "/bin/bash", "--groups", group, user)
            made_users.append(user)
        else:
            run_ok("usermod", "--append", "--groups", group, user)
        Path("/home", user).chmod(0o700)  # what cluster_setup/README.md asks of home directories
        passwords[user] = secrets.token_urlsafe(16)
        run_ok("chpasswd", input=f"{user}:{passwords[user]}")
    yield passwords
    for user in passwords:
        for pid in user_pids(user):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # exited meanwhile
                pass
        wait_for(lambda user=user: not user_pids(user), 10, f"{user}'s processes to exit")
    for user in made_users:
        run_ok("userdel", "--remove", user)
    for group in made_groups:
        run_ok("groupdel", group)


@dataclass
class Hub:
    url: str
    state_dir: Path
    log: Path

    @property
    def exchange(self) -> Path:
        return self.state_dir / "exchange"  # course_env_exchange_dir in hub/inventory.yml


@pytest.fixture(scope="module")
def hub(local_cluster: LocalCluster, accounts: dict[str, str]) -> Iterator[Hub]:
    state_dir = local_cluster.state_dir
    try:
        run_ok(HUB_SH, "start", env=local_cluster.env)
        config = (state_dir / "etc" / "hub" / "jupyterhub_config.py").read_text()
        ip = re.search(r'^c\.JupyterHub\.ip = "([^"]*)"$', config, re.M)[1]
        port = re.search(r"^c\.JupyterHub\.port = (\d+)$", config, re.M)[1]
        yield Hub(f"http://{ip}:{port}", state_dir, state_dir / "log" / "jupyterhub.log")
    finally:
        for user in accounts:
            local_cluster.run("scancel", "--user", user, check=False)
        run_ok(HUB_SH, "stop", env=local_cluster.env)
        shutil.rmtree(state_dir / "exchange" / COURSE_ID, ignore_errors=True)


class User:
    """A logged-in user and their JupyterLab, driven through the hub's proxy."""

    def __init__(self, hub: Hub, name: str, password: str):
        self.hub, self.name = hub, name
        self.session = requests.Session()
        self.session.get(f"{hub.url}/hub/login").raise_for_status()
        login = self.session.post(
            f"{hub.url}/hub/login",
            data={"username": name, "password": password, "_xsrf": self.session.cookies["_xsrf"]},
            allow_redirects=False,
        )
        assert login.status_code == 302, f"{name} could not log in: {login.status_code}"
        self.server = f"{hub.url}/user/{name}"

    def start_server(self) -> None:
        spawn = self.session.get(f"{self.hub.url}/hub/spawn", allow_redirects=False)
        assert spawn.status_code == 302, f"{self.name}'s spawn: {spawn.status_code}"

    def wait_ready(self) -> None:
        api = f"{self.hub.url}/hub/api/users/{self.name}"
        headers = {"X-XSRFToken": self.session.cookies.get("_xsrf", path="/hub/")}

        def ready() -> bool:
            servers = self.session.get(api, headers=headers).json()["servers"]
            return (servers.get("") or {}).get("ready", False)

        try:
            wait_for(ready, 90, f"{self.name}'s server")
        except AssertionError as timeout:
            log = self.hub.log.read_text().splitlines()[-40:]
            raise AssertionError(f"{timeout}; end of the hub's log:\n" + "\n".join(log)) from None
        # The server's own XSRF cookie, which its POST handlers check.
        self.lab_page = self.session.get(f"{self.server}/lab")
        assert self.lab_page.status_code == 200, self.lab_page.status_code

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        xsrf = self.session.cookies.get("_xsrf", path=f"/user/{self.name}/")
        return self.session.request(
            method, f"{self.server}{path}", headers={"X-XSRFToken": xsrf}, timeout=240, **kwargs
        )

    def formgrader(self, action: str) -> dict:
        """A Formgrader button: POST /formgrader/api/..., which answers {"success": ...}."""
        reply = self.request("POST", f"/formgrader/api/{action}")
        assert reply.status_code == 200, f"{action}: {reply.status_code} {reply.text[:2000]}"
        result = reply.json()
        assert result.get("success"), f"{action} failed: {json.dumps(result)[-3000:]}{self.log()}"
        return result

    def log(self) -> str:
        """The end of the server's log (batchspawner's job output, in the user's home)."""
        logs = sorted(Path("/home", self.name).glob("jupyterhub_slurmspawner_*.log"))
        return f"\nend of {logs[-1]}:\n" + logs[-1].read_text()[-3000:] if logs else ""

    def assignments(self, action: str | None = None) -> dict:
        """The Assignments panel: list, or fetch / submit / fetch_feedback this lab."""
        if action is None:
            reply = self.request("GET", "/assignments", params={"course_id": COURSE_ID})
        else:
            reply = self.request("POST", f"/assignments/{action}",
                                 data={"course_id": COURSE_ID, "assignment_id": LAB})
        assert reply.status_code == 200, f"{action}: {reply.status_code} {reply.text[:2000]}"
        result = reply.json()
        what = f"{self.name} {action}: {json.dumps(result)[-3000:]}"
        assert result.get("success"), what + self.log()
        return result

    def save_notebook(self, path: str, notebook: nbformat.NotebookNode) -> None:
        """Save a notebook as JupyterLab does (the contents API)."""
        body = {"type": "notebook", "format": "json", "content": notebook}
        reply = self.request("PUT", f"/api/contents/{path}", data=json.dumps(body))
        assert reply.status_code in (200, 201), reply.text[:2000]

    def disabled_extensions(self) -> str:
        return self.lab_page.text.split('"disabledExtensions"')[1][:2000]


def errors(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """Each cell that raised or wrote to stderr (which nbgrader scores 0 as well), by its
    grade id, with the end of what it wrote."""
    return {
        cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {index}"):
            (f"{output.ename}: {output.evalue}" if output.output_type == "error"
             else f"stderr: {output.text}")[-400:]
        for index, cell in enumerate(notebook.cells)
        for output in cell.get("outputs", [])
        if output.output_type == "error" or output.get("name") == "stderr"
    }


def short_cells(course: Path, student: str) -> dict[str, str]:
    """Each graded cell of the student's submission that scored below its points, from the
    course's gradebook: "score/points"."""
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(LAB, LAB, student)
        return {
            grade.name: f"{grade.score}/{grade.max_score}"
            for grade in notebook.grades
            if grade.score < grade.max_score
        }


def make_instructor_course(home: Path) -> Path:
    """The instructor's private clone of the course (only the files grading needs)."""
    course = home / COURSE_DIR
    shutil.rmtree(course, ignore_errors=True)
    course.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", course)
    shutil.copytree(REPO / "tools" / "grading", course / "tools" / "grading")
    shutil.copytree(REPO / "solutions" / LAB, course / "solutions" / LAB)
    owner = home.stat()
    for path in [course, *course.rglob("*")]:
        os.chown(path, owner.st_uid, owner.st_gid)
    return course


def test_graded_class_through_the_hub_and_the_exchange(
    local_cluster: LocalCluster, hub: Hub, accounts: dict[str, str]
) -> None:
    course = make_instructor_course(Path("/home", INSTRUCTOR))
    users = {name: User(hub, name, password) for name, password in accounts.items()}
    for user in users.values():
        user.start_server()
    for user in users.values():
        user.wait_ready()
    teacher = users[INSTRUCTOR]
    first, second = (users[name] for name in STUDENTS)

    # Roles: the instructor's JupyterLab has Formgrader, the students' only the Assignments panel.
    assert teacher.request("GET", "/formgrader").status_code == 200
    assert "@jupyter/nbgrader:formgrader" not in teacher.disabled_extensions()
    for student in (first, second):
        assert student.request("GET", "/formgrader").status_code == 404
        for plugin in ("formgrader", "create-assignment"):
            assert f"@jupyter/nbgrader:{plugin}" in student.disabled_extensions()

    # Release: Formgrader's "Generate" (which also makes the gradebook entries), then "Release".
    teacher.formgrader(f"assignment/{LAB}/assign")
    teacher.formgrader(f"assignment/{LAB}/release")
    assert (hub.exchange / COURSE_ID / "outbound" / LAB / f"{LAB}.ipynb").exists()

    # Students fetch the lab into their home directory: their own copy.
    solution = read_notebook(course / "solutions" / LAB / f"{LAB}.ipynb")
    for student in (first, second):
        listed = student.assignments()["value"]
        assert [(a["assignment_id"], a["status"]) for a in listed] == [(LAB, "released")], listed
        student.assignments("fetch")
    released = read_notebook(Path("/home", first.name, LAB, f"{LAB}.ipynb"))
    first.save_notebook(f"{LAB}/{LAB}.ipynb", answered(released, solution))
    for student in (first, second):
        student.assignments("submit")

    # Isolation: nobody but the instructor can read the instructor's course or a submission.
    inbound = hub.exchange / COURSE_ID / "inbound"
    submitted_by_first = next(inbound.glob(f"{first.name}+{LAB}+*"))
    for path in (
        course / "solutions" / LAB / f"{LAB}.ipynb",
        submitted_by_first / f"{LAB}.ipynb",
        Path("/home", first.name, LAB, f"{LAB}.ipynb"),
    ):
        denied = as_user(second.name, "cat", str(path))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, path
    assert as_user(second.name, "ls", str(inbound)).returncode != 0, "students can list inbound/"

    # Collect, autograde each submission, generate and release feedback: Formgrader's buttons.
    teacher.formgrader(f"assignment/{LAB}/collect")
    for student in (first, second):
        teacher.formgrader(f"submission/{LAB}/{student.name}/autograde")
    teacher.formgrader(f"assignment/{LAB}/generate_feedback")
    teacher.formgrader(f"assignment/{LAB}/release_feedback")

    # Each student fetches their own feedback, beside their copy of the lab.
    for student in (first, second):
        student.assignments("fetch_feedback")
        feedback = list(Path("/home", student.name, LAB, "feedback").glob(f"*/{LAB}.html"))
        assert len(feedback) == 1, f"{student.name}'s feedback: {feedback}"
        assert "BEGIN HIDDEN TESTS" not in feedback[0].read_text()

    # Export, as the instructor does in a terminal of their JupyterLab.
    exported = as_user(
        INSTRUCTOR, "env", f"JUPYTER_CONFIG_PATH={hub.state_dir}/etc/jupyter/instructors",
        "bash", "-c", f"cd {course} && {REPO}/.venv/bin/nbgrader export",
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    with open(course / "grades.csv") as grades:
        rows = {row["student_id"]: row for row in csv.DictReader(grades)}
    graded = read_notebook(course / "autograded" / first.name / LAB / f"{LAB}.ipynb")
    assert rows[first.name]["score"] == rows[first.name]["max_score"], (
        f"the solution scored {rows[first.name]['score']} of {rows[first.name]['max_score']}; "
        f"cells short of their points: {short_cells(course, first.name)}; "
        f"cells that raised or wrote to stderr: {errors(graded)}"
    )
    assert float(rows[second.name]["score"]) == 0 and rows[second.name]["status"] == "submitted"
