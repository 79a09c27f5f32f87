"""Memory beyond the GPU: where each byte of model state lives, what crossing a tier costs.

Three tiers: the GPU's own memory ("device"), the CPU's memory ("host", across PCIe) and
disk ("nvme"). Offloading keeps on the device only what the forward and backward passes use,
the 16-bit parameters, and moves the rest out (ZeRO-Offload, Ren et al. 2021, §4):

    device  16-bit parameters (2Ψ; 2Ψ/N under ZeRO-3); ZeRO-1 also keeps whole gradients
    host    each rank's reduced gradient shard (2Ψ/N), moved out as backward produces it;
            fp32 master weights and Adam's m and v (12Ψ/N), which the CPU updates
    nvme    with the NVMe tier (ZeRO-Infinity, Rajbhandari et al. 2021) the 12Ψ/N go to
            disk, read and written shard by shard every step

Per step and rank, the reduced gradient shard crosses PCIe to the host and the updated
parameter shard comes back in the compute dtype: 2Ψ/N each way (4Ψ in all on one GPU, as
§4 counts); the NVMe tier also reads and writes the 12Ψ/N of optimizer state.

The time model (`offload_step_time`) adds to the step what the tiers cannot hide: the
gradient transfer beyond the backward pass it overlaps, the CPU optimizer's step (measured
throughput), the disk's reads and writes (measured bandwidth), and the parameters' way back.
PCIe x16 carries about 32 GB/s per direction at Gen4 (A100 servers) and 64 GB/s at Gen5
(H100 servers), theoretical (PCI-SIG; REFERENCES.md#pcie).

Pure functions of sizes, no torch. Bytes per rank; GB = 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.core._checks import one_of, positive, positive_int
from minidist.costs.memory import Precision, bytes_per_param, model_state_bytes

__all__ = ["TIERS", "OFFLOAD", "PCIE_BANDWIDTH", "MASTER_BYTES", "TierBytes", "Transfers",
           "OffloadStepTime", "model_state_by_tier", "offload_transfer_bytes", "nvme_bytes",
           "offload_step_time"]

TIERS = ("device", "host", "nvme")
OFFLOAD = (None, "host", "nvme")
"""Where the optimizer state can go: nowhere (it stays on the device), the host, or NVMe."""

PCIE_BANDWIDTH = {"gen4": 32e9, "gen5": 64e9}
"""Bytes/s per direction of a PCIe x16 link, theoretical (PCI-SIG): A100 servers are Gen4,
H100 servers Gen5."""


@dataclass(frozen=True)
class TierBytes:
    """Bytes of model state one rank keeps on each tier."""

    device: float
    host: float = 0.0
    nvme: float = 0.0

    @property
    def total(self) -> float:
        return self.device + self.host + self.nvme


@dataclass(frozen=True)
class Transfers:
    """Bytes one rank moves per step: across PCIe each way, and to and from disk."""

    to_host: float
    to_device: float
    disk_read: float = 0.0
    disk_written: float = 0.0


def _check(zero_stage: int, offload: str | None) -> None:
    one_of("zero_stage", zero_stage, (0, 1, 2, 3))
    one_of("offload", offload, OFFLOAD)


def model_state_by_tier(num_params: float, zero_stage: int = 2, dp: int = 1,
                        offload: str | None = None, precision: str | Precision = "bf16-mixed",
                        optimizer: str = "adam") -> TierBytes:
    """Bytes of parameters, gradients and optimizer state per rank on each tier.

    Without offload everything is on the device (`memory.model_state_bytes`). With it the
    device keeps the parameters (sharded under ZeRO-3), and under ZeRO-0/1 the whole
    gradients, which wait for the step there; the reduced gradient shard and the optimizer
    state (fp32 master, m, v) go to the host, or the state to NVMe. Mixed-precision Adam,
    ZeRO-2, offload="host": 2Ψ on the device, 14Ψ/N on the host (ZeRO-Offload §4).
    """
    _check(zero_stage, offload)
    state = model_state_bytes(num_params, zero_stage, dp, precision, optimizer)
    if offload is None:
        return TierBytes(device=state.total)
    grad_shard = bytes_per_param(precision, optimizer).grads * num_params / dp
    optimizer_bytes = _offloaded_state_bytes(precision, optimizer) * num_params / dp
    device = state.params + (state.grads if zero_stage < 2 else 0.0)
    if offload == "host":
        return TierBytes(device, host=grad_shard + optimizer_bytes)
    return TierBytes(device, host=grad_shard, nvme=optimizer_bytes)


def offload_transfer_bytes(num_params: float, dp: int = 1, offload: str | None = "host",
                           precision: str | Precision = "bf16-mixed",
                           optimizer: str = "adam") -> Transfers:
    """What one rank moves per step with its optimizer state offloaded: its reduced gradient
    shard to the host (Ψ/N gradient elements), its updated parameter shard back in the
    compute dtype (Ψ/N parameter elements), and on the NVMe tier its optimizer state read
    and written once (`nvme_bytes`). Without offload nothing crosses."""
    one_of("offload", offload, OFFLOAD)
    positive(num_params=num_params)
    positive_int(dp=dp)
    if offload is None:
        return Transfers(0.0, 0.0)
    per_param = bytes_per_param(precision, optimizer)
    disk = nvme_bytes(num_params, dp, precision, optimizer) if offload == "nvme" else 0.0
    return Transfers(to_host=per_param.grads * num_params / dp,
                     to_device=per_param.params * num_params / dp,
                     disk_read=disk, disk_written=disk)


def nvme_bytes(num_params: float, dp: int = 1, precision: str | Precision = "bf16-mixed",
               optimizer: str = "adam", first_step: bool = False) -> float:
    """Bytes of optimizer state (fp32 master weights and the optimizer's states) one rank
    reads, and as many it writes, per step on the NVMe tier: 12Ψ/N for Adam. On the first
    step only the master weights are read (4Ψ/N): the optimizer creates its state then."""
    positive(num_params=num_params)
    positive_int(dp=dp)
    per_element = MASTER_BYTES if first_step else _offloaded_state_bytes(precision, optimizer)
    return per_element * num_params / dp


MASTER_BYTES = 4
"""An offloaded optimizer updates an fp32 master copy on the host, whatever the device's
parameters are: even fp32 training keeps one there, apart from the device's copy."""


def _offloaded_state_bytes(precision: str | Precision, optimizer: str) -> float:
    """Bytes per parameter of the fp32 master weights and optimizer states off the device:
    12 for Adam, mixed precision or not."""
    stateless = bytes_per_param(precision, "sgd").optimizer  # the master copy alone, if any
    return MASTER_BYTES + bytes_per_param(precision, optimizer).optimizer - stateless


@dataclass(frozen=True)
class OffloadStepTime:
    """Predicted seconds of one step with offload, per part that is not hidden."""

    compute: float
    to_host: float  # the gradient transfer beyond the backward pass it overlaps
    optimizer: float  # the CPU optimizer's step
    disk: float  # NVMe reads and writes of the optimizer state
    to_device: float  # the updated parameters' way back

    @property
    def total(self) -> float:
        return self.compute + self.to_host + self.optimizer + self.disk + self.to_device


def offload_step_time(num_params: float, dp: int, compute: float, offload: str | None,
                      pcie_bandwidth: float, optimizer_throughput: float,
                      disk_read_bandwidth: float | None = None,
                      disk_write_bandwidth: float | None = None,
                      precision: str | Precision = "bf16-mixed", optimizer: str = "adam",
                      backward_share: float = 2 / 3) -> OffloadStepTime:
    """One rank's step time with its optimizer state on `offload` ("host" or "nvme").

        compute    forward + backward on the GPU, seconds (from FLOPs, or measured)
        to_host    the gradient shard crosses PCIe during backward: only the part longer
                   than backward (`backward_share` of compute) shows
        optimizer  Ψ/N parameters at `optimizer_throughput` parameters/s (the CPU's
                   measured rate), after the last gradient has arrived
        disk       NVMe: the state read at `disk_read_bandwidth` and written at
                   `disk_write_bandwidth` bytes/s, shard by shard, not overlapped here
        to_device  the parameter shard back across PCIe before the next forward

    Without offload the step is `compute` alone (the GPU's optimizer step is counted in it).
    ZeRO-Offload's one-step delayed parameter update would overlap the CPU step and both
    transfers with the next step's compute; this model does not.
    """
    positive(compute=compute, pcie_bandwidth=pcie_bandwidth,
             optimizer_throughput=optimizer_throughput)
    if not 0 <= backward_share <= 1:
        raise ValueError(f"backward_share={backward_share}: the share of compute that is the "
                         f"backward pass, in [0, 1]")
    moved = offload_transfer_bytes(num_params, dp, offload, precision, optimizer)
    if offload is None:
        return OffloadStepTime(compute, 0.0, 0.0, 0.0, 0.0)
    disk = 0.0
    if offload == "nvme":
        if disk_read_bandwidth is None or disk_write_bandwidth is None:
            raise ValueError("offload='nvme' needs disk_read_bandwidth and "
                             "disk_write_bandwidth (bytes/s): measure them with "
                             "minidist.parallel.nvme.measure_disk(folder)")
        positive(disk_read_bandwidth=disk_read_bandwidth,
                 disk_write_bandwidth=disk_write_bandwidth)
        disk = moved.disk_read / disk_read_bandwidth + moved.disk_written / disk_write_bandwidth
    to_host = max(0.0, moved.to_host / pcie_bandwidth - backward_share * compute)
    return OffloadStepTime(compute, to_host, num_params / dp / optimizer_throughput, disk,
                           moved.to_device / pcie_bandwidth)
