"""The resumable training job: killed twice under torchrun, it prints an uninterrupted run's
losses bit for bit; a NaN on one rank skips the step on all; a hung peer ends the job."""

import os
import re
import signal
import subprocess
import sys

import pytest

from minidist.launch import run
from minidist.train import GradientGuard, TrainConfig, train

LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _torchrun(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node=2 --standalone ... -m minidist.train ...` (loopback
    rendezvous); on a timeout its workers are stopped with it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--standalone", *arguments]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, job.returncode, out, err)


def test_a_job_killed_at_steps_3_and_7_resumes_bit_for_bit(tmp_path):
    uninterrupted = run(train, 2, TrainConfig(steps=12, checkpoint_dir=str(tmp_path / "once"),
                                              checkpoint_every=5), timeout=120)[0]
    expected = {step: loss.hex() for step, loss in uninterrupted.items()}
    done = _torchrun("--max-restarts=2", "-m", "minidist.train", "--steps", "12",
                     "--checkpoint-dir", str(tmp_path / "failing"), "--checkpoint-every", "5",
                     "--fail-at-step", "3", "7", "--fail-rank", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    for step in (3, 7):
        assert f"rank 1: injected failure at step {step}" in done.stderr, done.stderr
    assert "resumed from" in done.stdout and "step_00000005 at step 5" in done.stdout, done.stdout
    printed = LOSS_LINE.findall(done.stdout)
    assert sorted({int(step) for step, _ in printed}) == list(range(1, 13)), done.stdout
    # Steps run again after a restart print again: every line must be the uninterrupted one.
    wrong = [(int(step), loss, expected[int(step)]) for step, loss in printed
             if loss != expected[int(step)]]
    assert not wrong, f"(step, resumed loss, uninterrupted loss) differing: {wrong}"


def test_a_nan_on_one_rank_skips_the_step_everywhere_and_a_hung_peer_ends_the_job(tmp_path):
    done = _torchrun("-m", "minidist.train", "--steps", "6", "--checkpoint-dir", str(tmp_path),
                     "--checkpoint-every", "10", "--nan-at-step", "2", "--nan-rank", "1",
                     "--hang-at-step", "4", "--hang-rank", "1", "--collective-timeout", "5")
    assert done.returncode != 0, done.stdout
    assert "step 2: non-finite loss on rank(s) [1], non-finite gradients on rank(s) [0, 1]: " \
           "step skipped on all ranks" in done.stdout, done.stdout
    printed = [int(step) for step, _ in LOSS_LINE.findall(done.stdout)]
    assert printed == [1, 3], f"expected loss lines for steps 1 and 3, got {printed}"
    assert "error: rank 0, step 4: a collective waited more than 5 s; a peer died or hangs" \
        in done.stderr, done.stderr[-3000:]


def test_a_gradient_norm_spike_is_reported_and_clipped():
    guard = GradientGuard(factor=5.0, warmup=3)
    for norm in (1.0, 2.0, 3.0):
        assert guard.clip_factor(norm) == (1.0, None)
    scale, report = guard.clip_factor(100.0)
    assert scale == pytest.approx(0.1), f"expected 100 clipped to 5 x mean 2 = 10, got {scale}"
    assert report == "gradient norm 100 is 50.0x the mean of the last 3 steps; clipped to 10", \
        report
    assert guard.history == [1.0, 2.0, 3.0, pytest.approx(10.0)], guard.history
