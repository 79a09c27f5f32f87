"""minidist.parallel.param_server on 6 gloo ranks (workers 0-3, servers 4 and 5), in one launch: the
synchronous server equals all-reduce data parallelism, bytes per worker and per server match
minidist.costs.traffic's formulas, the asynchronous server converges and records its staleness."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.communication import comm
from minidist.communication.counting import count_traffic
from minidist.core.launch import run
from minidist.costs.cost import all_reduce_time, parameter_server_time
from minidist.costs.traffic import parameter_server_traffic
from minidist.parallel.models import MLP
from minidist.parallel.param_server import ParameterServer, stale_gradient_descent

WORKERS, SERVERS = [0, 1, 2, 3], [4, 5]
STEPS = 5


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP(12, 32, 5, depth=3)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=generator), torch.randn(16, 5, generator=generator))
            for _ in range(steps)]


def _start() -> torch.nn.Linear:
    torch.manual_seed(3)
    return torch.nn.Linear(8, 1, bias=False)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_worker(model, batches, rank, sync) -> None:
    for x, y in batches:
        model.zero_grad()
        F.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
        sync()


def _ranks(rank: int, world_size: int) -> dict[str, object]:
    found: dict[str, object] = {}
    worker_group = dist.new_group(WORKERS)  # every rank must take part in creating it
    batches = _batches(STEPS)
    is_worker = rank in WORKERS
    if is_worker:  # all-reduce data parallelism on the workers: the reference
        reference = _model()
        optimizer = _sgd(reference.parameters())

        def all_reduce_step():
            for p in reference.parameters():
                comm.ring_all_reduce(p.grad, op="avg", group=worker_group)
            optimizer.step()

        _train_worker(reference, batches, rank, all_reduce_step)
    for servers in ([4], SERVERS):
        if rank not in WORKERS + servers:
            continue
        model = _model()
        ps = ParameterServer(model, WORKERS, servers, _sgd)
        with count_traffic() as log:
            if ps.is_server:
                ps.serve(STEPS)
            else:
                _train_worker(model, batches, rank, ps.push_pull)
        found[f"bytes k={len(servers)}"] = log.bytes_sent / STEPS
        if is_worker:
            found[f"error k={len(servers)}"] = max(
                (a - b).abs().max().item()
                for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    # Asynchronous, on a least-squares problem: each worker owns a quarter of the rows.
    generator = torch.Generator().manual_seed(2)
    a, x_true = torch.randn(64, 8, generator=generator), torch.randn(8, generator=generator)
    b = a @ x_true
    weights = _start()
    ps = ParameterServer(weights, WORKERS, SERVERS,
                         lambda params: torch.optim.SGD(params, lr=0.05), asynchronous=True)
    if ps.is_server:
        ps.serve(60)
        found["staleness"] = ps.staleness
    else:
        rows = slice(16 * rank, 16 * rank + 16)
        for _ in range(60):
            weights.zero_grad()
            F.mse_loss(weights(a[rows]).squeeze(1), b[rows]).backward()
            ps.push_pull()
        found["async loss"] = F.mse_loss(weights(a).squeeze(1), b).item()
        found["start loss"] = F.mse_loss(_start()(a).squeeze(1), b).item()
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run(_ranks, 6, timeout=120)


def test_synchronous_server_trains_like_all_reduce_data_parallelism(results):
    for rank in WORKERS:
        for k in (1, 2):
            error = results[rank][f"error k={k}"]
            assert error <= 1e-6, (f"worker {rank}, {k} server(s): parameters after {STEPS} "
                                   f"steps differ from all-reduce DP by {error:.2e}, expected "
                                   f"<= 1e-6")


def test_bytes_per_worker_and_per_server_match_the_formulas(results):
    nbytes = 4 * sum(p.numel() for p in _model().parameters())
    for k in (1, 2):
        formula = parameter_server_traffic(nbytes, len(WORKERS), k)
        for rank in WORKERS + SERVERS[:k]:
            role = "server" if rank >= 4 else "worker"
            expected, got = formula[role].bytes_sent, results[rank][f"bytes k={k}"]
            assert abs(got - expected) <= 0.01 * expected, (
                f"{role} rank {rank}, {k} server(s): expected {expected:.0f} B per step "
                f"(traffic.parameter_server_traffic), counted {got:.0f}")


def test_asynchronous_server_converges_and_records_staleness(results):
    for rank in WORKERS:
        start, end = results[rank]["start loss"], results[rank]["async loss"]
        assert end < 0.01 * start, (f"rank {rank}: expected the asynchronous server's loss "
                                    f"below 1% of {start:.3f}, got {end:.4f}")
    for server in SERVERS:
        staleness = results[server]["staleness"]
        assert len(staleness) == 60 * len(WORKERS) and min(staleness) >= 0, (
            f"server {server}: expected {60 * len(WORKERS)} staleness entries >= 0, got "
            f"{len(staleness)} (min {min(staleness)})")
        # No bound holds for one update (a worker the OS parks may miss any number of them),
        # but one does for the mean: every update a worker misses is another worker's, made
        # while it computed, so each worker's staleness adds up to at most the others' updates.
        mean = sum(staleness) / len(staleness)
        assert mean <= len(WORKERS) - 1, (
            f"server {server}: expected a mean staleness of at most {len(WORKERS) - 1} "
            f"(workers - 1) with {len(WORKERS)} workers, got {mean:.2f}")


def test_one_server_link_is_the_bottleneck_as_n_grows():
    """Bytes on the server's link N·S each way against the ring's 2(N-1)/N·S: N²/(N-1)."""
    alpha, beta, nbytes = 20e-6, 1e-9, 1e9
    for n in (2, 8, 64):
        ratio = (parameter_server_time(nbytes, n, 1, alpha, beta)
                 / all_reduce_time("ring", nbytes, n, alpha, beta))
        expected = n * n / (n - 1)
        assert abs(ratio - expected) < 0.01 * expected, (
            f"N={n}: expected the one-server step {expected:.2f}x the ring's, got {ratio:.2f}x")


def test_staleness_slows_convergence_in_the_model():
    fresh, stale = (stale_gradient_descent([1.0, 0.5], 0.3, tau, 40)[-1] for tau in (0, 4))
    assert stale > fresh, f"expected staleness 4 to end above {fresh:.2e}, got {stale:.2e}"
    with pytest.raises(ValueError, match="staleness=-1"):
        stale_gradient_descent([1.0], 0.1, -1, 10)
