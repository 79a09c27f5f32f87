"""JupyterHub with batchspawner's SlurmSpawner on the local Slurm cluster.

The hub runs from the configuration roles/jupyterhub renders (cluster_setup/local/hub/hub.sh):
a student logs in with a password (PAM), their JupyterLab starts as a Slurm job on a fake GPU
node and answers through the proxy, stopping it cancels the job, and nothing answers a request
that carries no login or token.
"""

import json
import os
import re
import secrets
import signal
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from cluster_fixtures import LocalCluster, run_ok, wait_for

pytestmark = [
    pytest.mark.xdist_group("cluster"),
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: creates a test account, and runs JupyterHub, which checks passwords "
        "with PAM and submits Slurm jobs as that account on the local cluster",
    ),
]

REPO = Path(__file__).resolve().parents[1]
HUB_SH = REPO / "cluster_setup" / "local" / "hub" / "hub.sh"
STUDENT = "slstudent"
STUDENTS_GROUP = "slstudents"  # jupyterhub_students_group in cluster_setup/local/hub/inventory.yml
GRES = "gpu:1"  # jupyterhub_gres there


@dataclass
class Hub:
    url: str  # the public side, through configurable-http-proxy
    ports: list[tuple[str, int]]  # everything the hub and its proxy listen on
    db: Path
    log: Path

    def spawner(self, user: str) -> tuple[str, int, dict]:
        """The user's server address and the spawner's saved state (batchspawner's job_id)."""
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as db:
            ip, port, state = db.execute(
                "SELECT servers.ip, servers.port, spawners.state FROM spawners "
                "JOIN users ON users.id = spawners.user_id "
                "JOIN servers ON servers.id = spawners.server_id WHERE users.name = ?",
                (user,),
            ).fetchone()
        return ip, port, json.loads(state)




def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def student_pids() -> list[int]:
    found = subprocess.run(["pgrep", "--uid", STUDENT], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.fixture(scope="module")
def student_password() -> Iterator[str]:
    """A local account in the hub's allowed group, with a fresh password. Afterwards its
    processes are killed, and the account and group are removed if this fixture made them."""
    made_group = (
        subprocess.run(["getent", "group", STUDENTS_GROUP], capture_output=True).returncode != 0
    )
    if made_group:
        run_ok("groupadd", STUDENTS_GROUP)
    made = subprocess.run(["id", STUDENT], capture_output=True).returncode != 0
    if made:
        run_ok("useradd", "--create-home", "--shell", "/bin/bash", "--groups", STUDENTS_GROUP,
               STUDENT)
    else:
        run_ok("usermod", "--append", "--groups", STUDENTS_GROUP, STUDENT)
    password = secrets.token_urlsafe(16)
    run_ok("chpasswd", input=f"{STUDENT}:{password}")
    yield password
    for pid in student_pids():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not student_pids(), 10, f"{STUDENT}'s processes to exit")
    if made:
        run_ok("userdel", "--remove", STUDENT)
    if made_group:
        run_ok("groupdel", STUDENTS_GROUP)


@pytest.fixture(scope="module")
def hub(local_cluster: LocalCluster, student_password: str) -> Iterator[Hub]:
    """hub.sh start (renders the role's config, starts hub and proxy); afterwards the student's
    jobs are cancelled, hub.sh stop, and no port of the hub or its proxy is left open."""
    state_dir = local_cluster.state_dir
    try:
        run_ok(HUB_SH, "start", env=local_cluster.env)
        config = (state_dir / "etc" / "hub" / "jupyterhub_config.py").read_text()

        def setting(name: str) -> str:
            return re.search(rf'^c\.{re.escape(name)} = "?([^"\n]*)"?$', config, re.M)[1]

        def address(url: str) -> tuple[str, int]:
            host, port = url.removeprefix("http://").split(":")
            return host, int(port)

        public = (setting("JupyterHub.ip"), int(setting("JupyterHub.port")))
        hub = Hub(
            url="http://{}:{}".format(*public),
            ports=[
                public,
                address(setting("JupyterHub.hub_bind_url")),
                address(setting("ConfigurableHTTPProxy.api_url")),
            ],
            db=state_dir / "hub" / "jupyterhub.sqlite",
            log=state_dir / "log" / "jupyterhub.log",
        )
        yield hub
    finally:
        local_cluster.run("scancel", "--user", STUDENT, check=False)
        run_ok(HUB_SH, "stop", env=local_cluster.env)
    assert not [port for port in hub.ports if listening(*port)], "hub or proxy still listening"


def log_in(session: requests.Session, hub: Hub, password: str) -> requests.Response:
    session.get(f"{hub.url}/hub/login").raise_for_status()
    return session.post(
        f"{hub.url}/hub/login",
        data={"username": STUDENT, "password": password, "_xsrf": session.cookies["_xsrf"]},
        allow_redirects=False,
    )


def test_lab_runs_as_a_slurm_job_behind_the_login(
    local_cluster: LocalCluster, hub: Hub, student_password: str
):
    lab = f"/user/{STUDENT}/lab"
    anonymous = requests.get(f"{hub.url}/hub/")
    assert anonymous.url == f"{hub.url}/hub/login?next=%2Fhub%2F", "no login page for a stranger"

    student = requests.Session()
    assert log_in(student, hub, "not-the-password").status_code == 403
    assert log_in(student, hub, student_password).status_code == 302
    xsrf = {"X-XSRFToken": student.cookies.get("_xsrf", path="/hub/")}
    api = f"{hub.url}/hub/api/users/{STUDENT}"

    # Spawning submits a Slurm job as the student; the hub waits for its server to call back.
    assert student.get(f"{hub.url}/hub/spawn", allow_redirects=False).status_code == 302
    try:
        wait_for(
            lambda: (student.get(api, headers=xsrf).json()["servers"].get("") or {}).get("ready"),
            60,
            "the student's server to be ready",
        )
    except AssertionError as timeout:
        log = hub.log.read_text().splitlines()[-40:]
        raise AssertionError(f"{timeout}; end of {hub.log}:\n" + "\n".join(log)) from None
    ip, port, state = hub.spawner(STUDENT)
    job_id = state["job_id"]
    job = local_cluster.job_fields(job_id)
    assert job["JobState"] == "RUNNING" and job["UserId"].startswith(f"{STUDENT}("), job
    assert job["TresPerNode"] == f"gres:{GRES}", job
    assert job["NodeList"] in ("gpu01", "gpu02") and ip.startswith("10.213.7."), (job, ip)

    page = student.get(f"{hub.url}{lab}")
    assert page.status_code == 200 and page.url == f"{hub.url}{lab}", page.url
    assert "<title>JupyterLab</title>" in page.text

    # Without the student's login, the proxy's route to the server leads to the hub's login page,
    # and the server itself (on the node) answers nothing without a token.
    stranger = requests.get(f"{hub.url}{lab}", allow_redirects=False)
    assert stranger.status_code in (302, 303, 403), stranger.status_code
    assert requests.get(f"{hub.url}{lab}").url.startswith(f"{hub.url}/hub/login")
    direct = f"http://{ip}:{port}/user/{STUDENT}"
    assert requests.get(f"{direct}/api/status").status_code == 403
    forged = {"Authorization": "token not-a-token"}
    assert requests.get(f"{direct}/api/contents", headers=forged).status_code == 403
    to_login = requests.get(f"{direct}/lab", allow_redirects=False)
    assert to_login.status_code == 302, to_login.status_code
    assert "/hub/api/oauth2/authorize" in to_login.headers["Location"]

    # Stopping the server through the hub's API cancels the job.
    assert student.delete(f"{api}/server", headers=xsrf).status_code in (202, 204)
    wait_for(
        lambda: local_cluster.job_fields(job_id)["JobState"] == "CANCELLED",
        15,
        f"job {job_id} to be CANCELLED",
    )
    wait_for(lambda: not student.get(api, headers=xsrf).json()["servers"], 15, "no server")
    assert not listening(ip, port)
