"""Parameter servers: the architecture all-reduce replaced for dense models, from send/recv.

Li et al. (OSDI 2014): server ranks hold the parameters, worker ranks compute gradients. Every
step each worker pushes its gradient to the servers and pulls the updated parameters back. With
k servers, server j holds shard j of the flat parameter vector (`comm.chunk_bounds`). What each
role's link carries per step, against ring all-reduce, and so why data parallelism on dense
models moved to all-reduce, is Lab 10's first prediction;
`minidist.costs.traffic.parameter_server_traffic` and `minidist.costs.cost.parameter_server_time`
count it, and this module is measured against them.

    ps = ParameterServer(model, workers=[0, 1, 2, 3], servers=[4],
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    if ps.is_server:
        ps.serve(steps)                 # until every worker has pushed `steps` gradients
    else:
        for x, y in batches:
            loss_fn(model(x), y).backward()
            ps.push_pull()              # model now holds the servers' new parameters

Synchronous (the default): a server waits for every worker's gradient, averages them in worker
order, takes one optimizer step and sends the same parameters to all: data parallelism exactly.
Asynchronous (`asynchronous=True`): a server applies each gradient as it arrives (not averaged:
one gradient, one update) and replies to that worker alone, so no worker ever waits for another.
A gradient may then have been computed on parameters some updates old; `staleness` records, per
update, how many updates the server applied since that worker pulled its parameters (Dean et al.
2012's Downpour SGD; Li et al. 2014's bounded delay). `stale_gradient_descent` shows what
staleness does to convergence without any ranks.

The server's optimizer sees one flat shard, so use an elementwise one (SGD, momentum, Adam):
those update a shard exactly as they update the whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from minidist.communication.comm import chunk_bounds
from minidist.core._checks import positive, positive_int, require_process_group
from minidist.core.flat import copy_back, flatten

__all__ = ["ParameterServer", "stale_gradient_descent"]


class ParameterServer:
    """One training job's servers and workers; build it on every one of their ranks.

    `workers` and `servers` are disjoint lists of global ranks. Every rank passes the same
    model architecture; at construction each server takes its shard of its own `model`'s
    parameters and sends it to every worker, so all workers start from the servers' values.
    `optimizer` builds the server's optimizer from a list holding its one shard parameter.
    """

    def __init__(self, model: nn.Module, workers: Sequence[int], servers: Sequence[int],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 *, asynchronous: bool = False):
        require_process_group("ParameterServer")
        self.workers, self.servers = list(workers), list(servers)
        if not self.workers or not self.servers or set(self.workers) & set(self.servers):
            raise ValueError(f"workers={self.workers} and servers={self.servers} must be two "
                             f"non-empty lists of distinct global ranks")
        self.rank = dist.get_rank()
        if self.rank not in self.workers + self.servers:
            raise ValueError(f"rank {self.rank} is neither a worker {self.workers} nor a server "
                             f"{self.servers}: build the ParameterServer on those ranks only")
        self.is_server = self.rank in self.servers
        self.asynchronous = asynchronous
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.bounds = chunk_bounds(self.numel, len(self.servers))
        self.staleness: list[int] = []  # a server's, one entry per update (asynchronous)
        flat = flatten(self.params)
        if self.is_server:
            start, end = self.bounds[self.servers.index(self.rank)]
            self.shard = nn.Parameter(flat[start:end].clone())
            self.optimizer = optimizer([self.shard])
            _wait_all(dist.isend(self.shard.detach(), worker) for worker in self.workers)
        else:
            self._flat = flat
            self._pull_into(flat)

    # --- Worker side -----------------------------------------------------------------------------

    def push_pull(self) -> None:
        """Send this worker's gradients to the servers, wait for the new parameters, load them.

        A parameter without a gradient pushes zeros."""
        if self.is_server:
            raise RuntimeError(f"rank {self.rank} is a server: workers call push_pull(), "
                               f"servers call serve(steps)")
        grad = flatten([torch.zeros_like(p) if p.grad is None else p.grad for p in self.params])
        pushes = [dist.isend(grad[start:end], server)
                  for server, (start, end) in zip(self.servers, self.bounds, strict=True)]
        self._pull_into(self._flat)
        _wait_all(pushes)

    def _pull_into(self, flat: torch.Tensor) -> None:
        _wait_all(dist.irecv(flat[start:end], server)
                  for server, (start, end) in zip(self.servers, self.bounds, strict=True))
        copy_back(flat, self.params)

    # --- Server side -----------------------------------------------------------------------------

    def serve(self, steps: int) -> None:
        """Serve until every worker has pushed `steps` gradients."""
        positive_int(steps=steps)
        if not self.is_server:
            raise RuntimeError(f"rank {self.rank} is a worker: servers call serve(steps), "
                               f"workers call push_pull()")
        if self.asynchronous:
            self._serve_asynchronously(steps)
        else:
            self._serve_synchronously(steps)

    def _serve_synchronously(self, steps: int) -> None:
        received = [torch.empty_like(self.shard) for _ in self.workers]
        for _ in range(steps):
            _wait_all(dist.irecv(buffer, worker)
                      for buffer, worker in zip(received, self.workers, strict=True))
            total = received[0].clone()
            for buffer in received[1:]:
                total.add_(buffer)
            self._update(total.div_(len(self.workers)))
            _wait_all(dist.isend(self.shard.detach(), worker) for worker in self.workers)

    def _serve_asynchronously(self, steps: int) -> None:
        received = torch.empty_like(self.shard)
        version = 0  # updates applied so far
        pulled_at = dict.fromkeys(self.workers, 0)  # the version each worker last received
        for _ in range(steps * len(self.workers)):
            worker = dist.recv(received)  # from whichever worker is ready first
            self.staleness.append(version - pulled_at[worker])
            self._update(received)
            version += 1
            dist.send(self.shard.detach(), worker)
            pulled_at[worker] = version

    def _update(self, grad: torch.Tensor) -> None:
        self.shard.grad = grad
        self.optimizer.step()


def _wait_all(requests) -> None:
    for request in list(requests):  # post every request before waiting on any
        request.wait()


def stale_gradient_descent(curvatures: Sequence[float], lr: float, staleness: int,
                           steps: int) -> list[float]:
    """Loss after each step of gradient descent on f(x) = ½ Σ c_i x_i² from x = 1, when every
    gradient is `staleness` updates old: x_{t+1} = x_t − lr · ∇f(x_{t−τ}).

    The model of an asynchronous parameter server with a fixed delay τ: no ranks, no noise.
    Each coordinate converges iff lr·c < 2 sin(π / (2(2τ+1))) (Levin & May 1976): 2 for τ = 0,
    1 for τ = 1, about π/(2τ) for large τ. A delay shrinks the stable learning rates, and near
    the bound the loss oscillates as it falls."""
    positive(lr=lr)
    positive_int(steps=steps)
    if staleness < 0:
        raise ValueError(f"staleness={staleness}: must be >= 0 updates")
    c = torch.tensor(curvatures, dtype=torch.float64)
    history = [torch.ones_like(c)] * (staleness + 1)  # x_{t-τ} .. x_t; before t = 0, x = 1
    losses = []
    for _ in range(steps):
        x = history[-1] - lr * c * history[0]
        history = history[1:] + [x]
        losses.append(float(0.5 * (c * x * x).sum()))
    return losses
