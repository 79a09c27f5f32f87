"""Fully sharded data parallel (ZeRO stage 3): every rank keeps 1/N of every parameter.

The model is cut into **units** (by default each child module that owns parameters, looking
inside ModuleList/Sequential containers, e.g. each transformer block). Each unit's parameters
are flattened into one fp32 vector (two if some are frozen); rank r keeps only its slice
(`collectives.shard_bounds`), which is the nn.Parameter the optimizer sees. Around each unit:

    forward  all-gather the unit's parameters (in `compute_dtype`), run it, free them;
             meanwhile the next unit's all-gather is already in flight (prefetch);
    backward all-gather them again just before the unit's backward, then reduce-scatter the
             gradients: rank r receives (the average of) its slice, and the full gradient and
             parameters are freed.

Three passes over Ψ parameters per step (two all-gathers, one reduce-scatter): 3Ψ traffic,
1.5× DDP, for model state 16Ψ/N (ZeRO §5 and §7).

Which unit holds a parameter follows PyTorch's FSDP2 (`fully_shard`), where each call manages
the parameters under its module that no nested call manages, and the call on the whole model
comes last:

- **Root unit.** Parameters in no chosen unit (a position embedding or a final scale owned by
  the model itself) belong to the root unit, the whole model. It is gathered first, when the
  model's forward starts, and kept until its gradient has been reduce-scattered at the end of
  backward, since backward needs it straight away (FSDP2 does not reshard its root after
  forward either). So the root's parameters are sent twice per step, not three times.
- **Tied weights.** A parameter used by several modules (a GPT-2 embedding shared with the
  output head) is sharded once, in the unit of the closest module that contains all its users:
  the root unit for an embedding and a head that are children of the model. FSDP2 requires one
  group per parameter too (it raises otherwise), and this is the placement its users choose by
  hand (wrapping neither the embedding nor the head).
  `full_state_dict()` returns it under every name `state_dict()` uses.
- **Frozen parameters** (requires_grad=False) are sharded and gathered like the others, in a
  flat vector of their own, but have no gradient to reduce-scatter. Backward still reads them
  (a frozen layer passes gradients through), so they are freed once backward has produced the
  unit's input gradient (as FSDP2 does), or when backward ends.
- **Buffers** are not sharded: every rank keeps a whole copy (rank 0's, copied at wrap time).

**Offload** (`offload="host"`): each shard, the fp32 master the optimizer updates, lives on
the host, so the optimizer and its state run there. Before a unit's first gather after a step,
its updated shard goes to the device in `compute_dtype` and stays there until the next step
changes it; each reduce-scattered gradient shard goes to the host as soon as backward produces
it (`minidist.parallel.offload`): Ψ/N elements each way per step, ZeRO-Offload's traffic. FSDP2's
`CPUOffloadPolicy` differs: it copies the shard in its own dtype to the device before every
all-gather (twice a step when resharding after forward) and the gradient out in that dtype.

Freeing works as in PyTorch's FSDP: the unit's layers see views of one gathered buffer, and
autograd keeps those views for backward; we release the buffer's storage after forward
(`untyped_storage().resize_(0)`) and refill the same storage before backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from minidist.communication import collectives, impls
from minidist.core._checks import require_process_group
from minidist.core.flat import flatten, views
from minidist.parallel.ddp import broadcast_parameters, check_same_model
from minidist.parallel.offload import Offload, to_device, to_host

__all__ = ["default_units", "FullyShardedDataParallel"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def default_units(module: nn.Module) -> list[nn.Module]:
    """Each child that owns parameters; containers are opened (they have no forward of their
    own that could host the hooks, or run their children one after another anyway)."""
    units = []
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            units += default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


@dataclass
class _Slot:
    """One parameter's place in a flat vector, and every (module, attribute) that uses it."""

    names: list[str]  # its keys in the model's state_dict (several if tied)
    users: list[tuple[nn.Module, str]]
    shape: torch.Size


class _Flat:
    """Parameters of one unit, all trainable or all frozen, flattened into one vector of which
    this rank keeps `shard` (the nn.Parameter the optimizer sees)."""

    def __init__(self, slots: list[_Slot], params: list[nn.Parameter],
                 group: dist.ProcessGroup | None, trainable: bool, offloaded: bool):
        self.slots, self.offloaded = slots, offloaded
        self.numel = sum(slot.shape.numel() for slot in slots)
        flat = flatten(params, torch.float32)
        start, end = collectives.shard_bounds(self.numel, group)
        mine = to_host(flat[start:end], "master weights") if offloaded else flat[start:end].clone()
        self.shard = nn.Parameter(mine, requires_grad=trainable)
        self.full: torch.Tensor | None = None  # the gathered parameters, while they exist
        self.pending: collectives.Handle | None = None
        self._on_device: tuple[int, torch.Tensor] | None = None  # (shard version, its copy)

    def shard_to_send(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The shard in `dtype`, on the device: with offload, a copy moved there after each
        change of the shard (an optimizer step updates it in place, bumping its version)."""
        if not self.offloaded:
            return self.shard.detach().to(dtype)
        version = self.shard._version
        if self._on_device is None or self._on_device[0] != version:
            moved = to_device(self.shard.detach().to(dtype), device, "parameter shard")
            self._on_device = (version, moved)
        return self._on_device[1]

    def holds_memory(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0


class _Unit:
    """One unit: its trainable and frozen flat vectors (either may be absent; the root unit
    may have neither) and the hooks' operations on them."""

    def __init__(self, name: str, flats: list[_Flat], owner: FullyShardedDataParallel):
        self.name, self.flats, self.owner = name, flats, owner

    def start_gather(self) -> None:
        for flat in self.flats:
            if flat.pending is None:
                shard = flat.shard_to_send(self.owner.compute_dtype, self.owner.device)
                flat.pending = collectives.all_gather(shard, flat.numel, group=self.owner.group,
                                                      impl=self.owner.impl, when="parameters",
                                                      async_op=True)

    def gather_for_forward(self) -> None:
        """Bring the parameters in (waiting for a prefetch if one is in flight), in a new
        buffer, and point the modules at views of it that autograd ties to the shard."""
        self.start_gather()
        for flat in self.flats:
            flat.full = self._wait(flat)
            shapes = [slot.shape for slot in flat.slots]
            params = (_GatheredParams.apply(flat.shard, flat.full, self, flat, *shapes)
                      if flat.shard.requires_grad else views(flat.full, shapes))
            for slot, view in zip(flat.slots, params, strict=True):
                for module, attribute in slot.users:
                    setattr(module, attribute, view)
        self._mark_gathered()

    def gather_for_backward(self) -> None:
        """Refill the storage that autograd's saved views still point to."""
        self.start_gather()
        for flat in self.flats:
            gathered = self._wait(flat)
            if flat.full is not None:
                flat.full.untyped_storage().resize_(gathered.untyped_storage().nbytes())
                flat.full.data.copy_(gathered)  # .data: autograd must not see a change
        self._mark_gathered()

    @staticmethod
    def _wait(flat: _Flat) -> torch.Tensor:
        gathered = flat.pending.wait()
        flat.pending = None
        return gathered

    def _mark_gathered(self) -> None:
        if self.flats:
            self.owner.gathered.add(self.name)
            self.owner.peak_gathered = max(self.owner.peak_gathered, len(self.owner.gathered))

    def free(self, flats: list[_Flat] | None = None, drop: bool = False) -> None:
        """Release the storage of `flats` (default all); `drop` also forgets the buffers, when
        no backward will refill them."""
        for flat in self.flats if flats is None else flats:
            if flat.full is not None:
                flat.full.untyped_storage().resize_(0)
            if drop:
                flat.full = None
        if not any(flat.holds_memory() for flat in self.flats):
            self.owner.gathered.discard(self.name)

    def frozen_flats(self) -> list[_Flat]:
        return [flat for flat in self.flats if not flat.shard.requires_grad]


class _GatheredParams(torch.autograd.Function):
    """shard → one view of the gathered parameters per parameter; backward reduce-scatters
    their gradients into the shard.

    The parameters are outputs of this one function, not slices taken of one gathered
    output afterwards: autograd would turn the gradient of each slice into a zero-filled
    tensor of the whole unit and add those up (k parameters, k full-size fills and adds),
    where here the k gradients are concatenated once. Autograd calls backward once every use
    of the parameters has added its gradient, i.e. when the unit's backward is done (for a
    tied weight: both users' backwards); a parameter that got none arrives as zeros."""

    @staticmethod
    def forward(ctx, shard, full, unit, flat, *shapes):
        ctx.unit, ctx.flat = unit, flat
        return tuple(views(full, list(shapes)))

    @staticmethod
    def backward(ctx, *grads):
        unit, flat = ctx.unit, ctx.flat
        owner = unit.owner
        grad_full = flatten(grads)
        grad = collectives.reduce_scatter(grad_full, group=owner.group, impl=owner.impl,
                                          when="gradients")
        if flat.offloaded:
            grad = to_host(grad, "gradient shard")
        unit.free([flat], drop=True)
        return grad.float().div_(owner.world_size), None, None, None, *(None for _ in grads)


class _FreeAfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward has produced
    the input gradients, the last moment the unit's frozen parameters are read."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.free(ctx.unit.frozen_flats(), drop=True)
        return None, *grads


def _closest_common_ancestor(paths: list[str]) -> str:
    """The longest dotted prefix shared by module paths ("" is the root)."""
    common = []
    for parts in zip(*(path.split(".") if path else [] for path in paths), strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _contains(unit_path: str, path: str) -> bool:
    return unit_path == "" or path == unit_path or path.startswith(unit_path + ".")


def _unit_paths(model: nn.Module, chosen: list[nn.Module]) -> list[str]:
    """The chosen units' paths in the model, the root ("") first."""
    paths = {module: path for path, module in model.named_modules()}
    for unit in chosen:
        if unit not in paths:
            raise ValueError(f"units() returned a {type(unit).__name__} that is not inside "
                             f"the wrapped {type(model).__name__}: return its submodules only")
        if isinstance(unit, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"units() returned {paths[unit]!r}, a {type(unit).__name__}: it is "
                             f"never called, so its hooks would never gather; return its "
                             f"children instead")
    return list(dict.fromkeys(["", *(paths[unit] for unit in chosen)]))


def _make_units(model: nn.Module, unit_paths: list[str],
                owner: FullyShardedDataParallel) -> list[_Unit]:
    """Place each parameter in the innermost unit containing all its users, flatten each
    unit's trainable and frozen parameters, and turn the originals into plain attributes
    (set to views of the gathered buffer while it exists). A chosen unit left with no
    parameters (its only one was tied and moved up) gets no hooks."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    placed: dict[str, list[tuple[_Slot, nn.Parameter]]] = {path: [] for path in unit_paths}
    for param, param_names in names.items():
        owners = [name.rpartition(".")[0] for name in param_names]
        ancestor = _closest_common_ancestor(owners)
        unit_path = max((p for p in unit_paths if _contains(p, ancestor)), key=len)
        users = [(model.get_submodule(module), name.rpartition(".")[2])
                 for module, name in zip(owners, param_names, strict=True)]
        placed[unit_path].append((_Slot(param_names, users, param.shape), param))
    units = []
    for path, slots in placed.items():
        flats = []
        for trainable in (True, False):
            mine = [(slot, p) for slot, p in slots if p.requires_grad == trainable]
            if mine:
                flats.append(_Flat([s for s, _ in mine], [p for _, p in mine], owner.group,
                                   trainable, owner.offload is not None))
        if flats or path == "":  # the root keeps its hooks: they start and end each step
            units.append(_Unit(path, flats, owner))
    for slots in placed.values():
        for slot, _ in slots:
            for module, attribute in slot.users:
                module._parameters.pop(attribute, None)
    return units


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 around `module`: 1/N of every unit's parameters per rank, gathered on demand.

        model = FullyShardedDataParallel(TinyGPT(...), compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the fp32 shards
        model.loss(ids, targets).backward(); optimizer.step()

    Gradients arrive averaged over the group (None: every rank) when backward returns.
    `units` picks the modules to shard together (default `default_units`); parameters outside
    them form the root unit, and tied parameters go to the unit of the closest module
    containing all their users. `impl="ring"` runs minidist's own all-gathers and
    reduce-scatters (`minidist.communication.collectives`), whose bytes `counting.count_traffic()`
    counts. `offload="host"` keeps the shards, hence the optimizer and its state, on the host.
    `reshard_after_forward=False` keeps each unit gathered from its forward to its backward
    (FSDP2's option of that name, FSDP1's SHARD_GRAD_OP): 2Ψ of traffic instead of 3Ψ, every
    unit's whole parameters in memory at the end of forward.

    Why one unit of about 150 lines: the hooks around each unit and what they share read best
    together; the units are built by `_make_units`, the gathering is `_Unit`'s."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 units: Callable[[nn.Module], list[nn.Module]] = default_units,
                 group: dist.ProcessGroup | None = None, impl: str = "torch",
                 prefetch: bool = True, offload: str | Offload | None = None,
                 reshard_after_forward: bool = True):
        super().__init__()
        require_process_group("FullyShardedDataParallel")
        impls.check_impl("all_gather", impl)
        self.group, self.impl, self.prefetch = group, impl, prefetch
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: True (free each "
                             f"unit after its forward, FSDP1's FULL_SHARD) or False (keep it "
                             f"gathered until its backward, SHARD_GRAD_OP)")
        self.reshard_after_forward = reshard_after_forward
        self.compute_dtype = compute_dtype or torch.float32
        self.offload = _check_offload(Offload.of(offload), module, self.world_size)
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        check_same_model(module, group)
        broadcast_parameters(module, group)
        self.module = module
        self._state_keys = list(module.state_dict())  # full_state_dict returns these
        self.gathered: set[str] = set()  # names of the units whose parameters are in memory
        self.peak_gathered = 0
        self.units = _make_units(module, _unit_paths(module, units(module)), self)
        for unit in self.units:
            for flat in unit.flats:
                kind = "shard" if flat.shard.requires_grad else "frozen_shard"
                self.register_parameter(f"{(unit.name or 'root').replace('.', '_')}_{kind}",
                                        flat.shard)
        for index, unit in enumerate(self.units):
            module.get_submodule(unit.name).register_forward_pre_hook(self._before_forward(index))
            module.get_submodule(unit.name).register_forward_hook(self._after_forward(index))

    @property
    def world_size(self) -> int:
        """The ranks every unit is sharded over: the group's size."""
        return dist.get_world_size(self.group)

    def _before_forward(self, index: int):
        unit = self.units[index]

        def hook(module, args):
            unit.gather_for_forward()
            if self.prefetch and index + 1 < len(self.units):
                self.units[index + 1].start_gather()
                self.gathered.add(self.units[index + 1].name)
                self.peak_gathered = max(self.peak_gathered, len(self.gathered))
            if self.compute_dtype != torch.float32:  # inputs follow the parameters' dtype
                args = tuple(a.to(self.compute_dtype)
                             if isinstance(a, torch.Tensor) and torch.is_floating_point(a) else a
                             for a in args)
            needing_grad = [i for i, a in enumerate(args)
                            if isinstance(a, torch.Tensor) and a.requires_grad]
            if needing_grad and unit.frozen_flats() and torch.is_grad_enabled():
                wrapped = _FreeAfterBackward.apply(unit, *(args[i] for i in needing_grad))
                args = list(args)
                for i, tensor in zip(needing_grad, wrapped, strict=True):
                    args[i] = tensor
            return tuple(args)

        return hook

    def _after_forward(self, index: int):
        unit = self.units[index]

        def hook(module, args, output):
            first_needing_grad = next(
                (t for t in tree_leaves(output)  # inside tuples, lists or dicts too
                 if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first_needing_grad is None:
                unit.free(drop=True)  # no backward will come through this unit
            elif index == 0:  # the root: kept for backward, which starts right away
                first_needing_grad.register_hook(self._on_backward_start)
            elif self.reshard_after_forward:
                unit.free()
                first_needing_grad.register_hook(lambda grad: unit.gather_for_backward())
            return output

        return hook

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        # `_on_backward_end` runs once this whole backward has finished (the engine calls it
        # before backward returns).
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        """Free what backward left gathered: frozen parameters of units whose inputs needed
        no gradient, and the parameters of units that got none (unused)."""
        for unit in self.units:
            unit.free(drop=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # model-specific methods (e.g. TinyGPT.loss) pass through
            if name == "module":
                raise
            return getattr(self.module, name)

    def reshard(self) -> None:
        """Drop every gathered parameter, prefetched and unused ones included, so that only
        the shards remain (FSDP2's `reshard()`); backward leaves nothing else gathered."""
        for unit in self.units:
            for flat in unit.flats:
                if flat.pending is not None:
                    flat.pending.wait()
                    flat.pending = None
            unit.free(drop=True)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model's state dict (the keys and order of `module.state_dict()`),
        fp32; a tied parameter appears under each of its names, as one tensor."""
        state = {name: buffer.clone() for name, buffer in self.module.state_dict().items()}
        for unit in self.units:
            for flat in unit.flats:
                full = collectives.all_gather(flat.shard.detach().to(self.device), flat.numel,
                                              group=self.group, impl=self.impl,
                                              when="full state dict")
                for slot, view in zip(flat.slots, views(full, [s.shape for s in flat.slots]),
                                      strict=True):
                    state.update(dict.fromkeys(slot.names, view.clone()))
        return {key: state[key] for key in self._state_keys}

    def sharded_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: shards plus any gathered units."""
        flats = [flat for unit in self.units for flat in unit.flats]
        held = sum(flat.shard.numel() * flat.shard.element_size() for flat in flats)
        return held + sum(flat.full.untyped_storage().nbytes() for flat in flats
                          if flat.full is not None)


def _check_offload(target: Offload | None, module: nn.Module, world_size: int) -> Offload | None:
    """Before any rank communicates: FSDP offloads to the host, which must hold this rank's
    fp32 shards, their gradients and Adam's two states (16 bytes per parameter / N)."""
    if target is None:
        return None
    if target.tier != "host":
        raise ValueError(f"FullyShardedDataParallel offloads to the host (offload='host', as "
                         f"FSDP2's CPUOffloadPolicy), got tier {target.tier!r}; the NVMe tier "
                         f"is ZeroOffloadOptimizer's: minidist.parallel.zero_offload."
                         f"ZeroOffloadOptimizer(..., offload=Offload('nvme', ...))")
    numel = sum(p.numel() for p in dict.fromkeys(module.parameters()))
    target.check_room(16 * -(-numel // world_size),
                      "the fp32 shards, their gradients and Adam's m and v")
    return target
