"""Each rank's latest collective or point-to-point call, for `minidist.core.launch.run`'s reports.

A rank that crashes, errs or hangs inside a collective says little by itself about why: gloo
aborts on a size mismatch without naming the other rank's call, and two ranks in different
collectives simply wait. So every rank `run` starts records each call as it starts (which op,
on which tensor shape and dtype, with which peer and group, from which line of the caller's
code) into its own slot of a small file the caller created; the caller reads the slots only
when something goes wrong or nothing moves, even after the rank died.

Recording has to be cheap (Lab 01 times all-reduces of a few KiB that take tens of
microseconds): a wrapper packs a few numbers and two cached strings into the slot, about a
microsecond; nothing is formatted until a report needs it. The recorder subscribes
(minidist.core.interposer, its outermost layer) to the torch.distributed functions a program
calls and to the two ProcessGroup methods that minidist.communication.comm's rings call
directly; a call made inside another recorded call (dist.send ends in ProcessGroup.send) is
not recorded again.
"""

from __future__ import annotations

import inspect
import mmap
import os
import struct
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.core import interposer
from minidist.core._groups import members as group_members

SLOT_BYTES = mmap.PAGESIZE  # one page per rank, so each rank maps its own slot alone

# States of the latest call.
IN_CALL, POSTED, RETURNED = 1, 2, 3  # POSTED: an asynchronous call returned its Work

_MAX_DIMS, _MAX_RANKS = 6, 512
# seq, group_seq, state, op, dtype, ndim, shape, list_len, peer, lineno, group name, members
# (a bitmask), file name, function name.
_RECORD = struct.Struct(f"<qqbbbb{_MAX_DIMS}qqqq32s{_MAX_RANKS // 8}s256s64s")
_STATE_OFFSET = 16

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(DTYPES)}

# op: (kind, argument holding the tensor described, argument naming the peer or root,
# "group rank" alternative of that argument). kind: "collective" calls match across a group,
# "p2p" pair a sender with a receiver, "async" are point-to-point calls that return a Work.
_OPS: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "all_reduce": ("collective", "tensor", None, None),
    "all_gather": ("collective", "tensor", None, None),
    "all_gather_into_tensor": ("collective", "input_tensor", None, None),
    "reduce_scatter": ("collective", "output", None, None),
    "reduce_scatter_tensor": ("collective", "output", None, None),
    "broadcast": ("collective", "tensor", "src", "group_src"),
    "reduce": ("collective", "tensor", "dst", "group_dst"),
    "gather": ("collective", "tensor", "dst", "group_dst"),
    "scatter": ("collective", "tensor", "src", "group_src"),
    "all_to_all": ("collective", "input_tensor_list", None, None),
    "all_to_all_single": ("collective", "input", None, None),
    "barrier": ("collective", None, None, None),
    "monitored_barrier": ("collective", None, None, None),
    "all_gather_object": ("collective", None, None, None),
    "broadcast_object_list": ("collective", None, "src", "group_src"),
    "gather_object": ("collective", None, "dst", "group_dst"),
    "scatter_object_list": ("collective", None, "src", "group_src"),
    "send": ("p2p", "tensor", "dst", "group_dst"),
    "recv": ("p2p", "tensor", "src", "group_src"),
    "send_object_list": ("p2p", None, "dst", "group_dst"),
    "recv_object_list": ("p2p", None, "src", "group_src"),
    # Recorded in ProcessGroup.send/recv, where dist.isend, dist.irecv and batch_isend_irecv
    # end: dist.isend itself must stay torch's, which P2POp checks by identity.
    "isend": ("async", "tensor", "dst", "group_dst"),
    "irecv": ("async", "tensor", "src", "group_src"),
}
OPS = [*_OPS]
# The same collective by another name: the calls can pair with each other.
FAMILY = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "monitored_barrier": "barrier"}
# Collectives whose described tensor has the same size on every rank.
SAME_SIZE = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "reduce"}


@dataclass(frozen=True)
class LatestCall:
    """One rank's latest recorded call, as the caller reads it back."""

    rank: int
    seq: int  # how many calls this rank had made, this one included
    group_seq: int  # how many collectives on this group, this one included (0 for p2p)
    state: int
    op: str
    dtype: str
    shape: tuple[int, ...]
    list_len: int  # -1 when the argument is a tensor, not a list of tensors
    peer: int  # global rank of the peer or root; -1 when none (or any source)
    group: str  # the process group's name, the same on every rank
    members: tuple[int, ...]
    filename: str
    lineno: int
    function: str

    @property
    def kind(self) -> str:
        return _OPS[self.op][0]

    @property
    def numel(self) -> int:
        return 0 if self.no_tensor else int(torch.Size(self.shape).numel())

    @property
    def no_tensor(self) -> bool:
        return self.dtype == ""

    @property
    def waiting(self) -> bool:
        return self.state in (IN_CALL, POSTED)

    def describe(self) -> str:
        """"all_gather of 64 float32", "recv of 4 float32 from rank 3", "barrier"."""
        text = self.op
        if not self.no_tensor:
            listed = f"a list of {self.list_len} tensors, the first " if self.list_len >= 0 else ""
            shape = f" (shape {list(self.shape)})" if len(self.shape) > 1 else ""
            text += f" of {listed}{self.numel} {self.dtype}{shape}"
        if self.peer >= 0:
            word = {"send": "to", "isend": "to", "send_object_list": "to"}.get(self.op, "from")
            if self.kind == "collective":
                word = "to" if self.op in ("reduce", "gather", "gather_object") else "from"
                text += f" {word} root {self.peer}"
            else:
                text += f" {word} rank {self.peer}"
        return text


# --- Inside a rank: recording ------------------------------------------------------------------


class _Recorder:
    def __init__(self, path: str, rank: int):
        with open(path, "r+b") as file:
            self.slot = mmap.mmap(file.fileno(), SLOT_BYTES, offset=rank * SLOT_BYTES)
        self.seq = 0
        self.busy = False  # inside a recorded call: calls it makes are not recorded
        self.group_seqs: dict[str, int] = {}
        self.groups: dict[object, tuple[bytes, bytes, tuple[int, ...]]] = {}
        self.places: dict[object, tuple[bytes, bytes]] = {}
        library = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
        self.torch_dir, self.library = library[0] + os.sep, tuple(d + os.sep for d in library)

    def group(self, group) -> tuple[bytes, bytes, tuple[int, ...]]:
        """(name, member bitmask, members) of a process group (None: the default one)."""
        found = self.groups.get(group)
        if found is None:
            key = group if group is not None else dist.group.WORLD
            try:
                members = group_members(key)
            except (ValueError, RuntimeError):  # a backend's own group, unknown to torch
                members = ()
            mask = bytearray(_MAX_RANKS // 8)
            for member in members:
                if member < _MAX_RANKS:
                    mask[member // 8] |= 1 << (member % 8)
            name = str(getattr(key, "group_name", "") or "").encode()[:32]
            found = self.groups[group] = (name, bytes(mask), members)
        return found

    def record(self, op: int, kind: str, tensor, peer, group, posted: bool) -> None:
        self.seq += 1
        name, mask, members = self.groups.get(group) or self.group(group)
        group_seq = 0
        if kind == "collective":
            group_seq = self.group_seqs[name] = self.group_seqs.get(name, 0) + 1
        list_len = -1
        if tensor.__class__ in (list, tuple):
            list_len, tensor = len(tensor), (tensor[0] if tensor else None)
        if isinstance(tensor, torch.Tensor):
            shape = tensor.shape
            ndim = len(shape)
            shape = (*shape, *_PADDING[ndim]) if ndim <= _MAX_DIMS else shape[:_MAX_DIMS]
            dtype = _DTYPE_INDEX.get(tensor.dtype, -2)
        else:
            shape, dtype, ndim = _PADDING[0], -1, 0
        # The caller: the first frame outside torch and minidist (else the first outside torch).
        frame = caller = sys._getframe(2)
        fallback = None
        while frame is not None:
            filename = frame.f_code.co_filename
            if not filename.startswith(self.library):
                break
            if fallback is None and not filename.startswith(self.torch_dir):
                fallback = frame
            frame = frame.f_back
        frame = frame or fallback or caller
        code = frame.f_code
        names = self.places.get(code)
        if names is None:
            names = self.places[code] = (code.co_filename.encode()[-256:],
                                         code.co_name.encode()[:64])
        _RECORD.pack_into(self.slot, 0, self.seq, group_seq, POSTED if posted else IN_CALL, op,
                          dtype, min(ndim, _MAX_DIMS), *shape, list_len,
                          -1 if peer is None else peer, frame.f_lineno, name, mask, *names)

    def returned(self) -> None:
        self.slot[_STATE_OFFSET] = RETURNED


_PADDING = [(0,) * (_MAX_DIMS - ndim) for ndim in range(_MAX_DIMS + 1)]


def _around(recorder: _Recorder, op: str, fn):
    """An interposer subscriber for `fn` (a torch.distributed function) recording each call as
    it starts."""
    kind, tensor_name, peer_name, group_peer_name = _OPS[op]
    parameters = inspect.signature(fn).parameters
    names = list(parameters)

    def position(name):  # where an argument is passed positionally, and its default
        if name not in parameters:
            return 1 << 30, None
        default = parameters[name].default
        return names.index(name), None if default is inspect.Parameter.empty else default

    (t_at, t_default), (p_at, p_default) = position(tensor_name), position(peer_name)
    (gp_at, _), (g_at, _), (a_at, _) = (position(group_peer_name), position("group"),
                                        position("async_op"))
    index, always_async = OPS.index(op), kind == "async"

    def recorded(proceed, *args, **kwargs):
        if recorder.busy:
            return proceed(*args, **kwargs)
        n = len(args)
        tensor = args[t_at] if n > t_at else kwargs.get(tensor_name, t_default)
        peer = args[p_at] if n > p_at else kwargs.get(peer_name, p_default)
        group = args[g_at] if n > g_at else kwargs.get("group")
        if peer is None and group_peer_name is not None:
            group_peer = args[gp_at] if n > gp_at else kwargs.get(group_peer_name)
            if group_peer is not None:
                peer = recorder.group(group)[2][group_peer]
        posted = always_async or bool(args[a_at] if n > a_at else kwargs.get("async_op"))
        recorder.record(index, kind, tensor, peer, group, posted)
        recorder.busy = True
        try:
            result = proceed(*args, **kwargs)
        finally:
            recorder.busy = False
        if not posted:
            recorder.returned()
        return result

    return recorded


def _around_method(recorder: _Recorder, op: str):
    """An interposer subscriber for ProcessGroup.send/recv(tensors, group rank, tag) -> Work:
    minidist.communication.comm's rings call them directly, skipping dist.isend's checks."""
    index = OPS.index(op)

    def recorded(proceed, group, tensors, group_rank, *args, **kwargs):
        if not recorder.busy:
            members = recorder.group(group)[2]
            peer = members[group_rank] if 0 <= group_rank < len(members) else group_rank
            recorder.record(index, "async", tensors, peer, group, posted=True)
        return proceed(group, tensors, group_rank, *args, **kwargs)

    return recorded


def install(path: str, rank: int) -> None:
    """Record this rank's calls into its slot of `path` from now on (the interposer's "calls"
    layer, for the rank's whole life)."""
    recorder = _Recorder(path, rank)
    for op in OPS:
        if _OPS[op][0] != "async":
            interposer.subscribe("calls", f"dist.{op}", _around(recorder, op, getattr(dist, op)))
    interposer.subscribe("calls", "ProcessGroup.send", _around_method(recorder, "isend"))
    interposer.subscribe("calls", "ProcessGroup.recv", _around_method(recorder, "irecv"))


# --- In the caller: reading ---------------------------------------------------------------------


def create(path: str, world_size: int) -> mmap.mmap:
    """The slots file for `world_size` ranks, zeroed (no call yet), mapped for reading."""
    with open(path, "w+b") as file:
        file.truncate(world_size * SLOT_BYTES)
        return mmap.mmap(file.fileno(), world_size * SLOT_BYTES)


def read(slots: mmap.mmap, rank: int) -> LatestCall | None:
    """Rank `rank`'s latest call, or None before its first."""
    fields = _RECORD.unpack_from(slots, rank * SLOT_BYTES)
    seq, group_seq, state, op, dtype, ndim = fields[:6]
    if seq == 0:
        return None
    shape = tuple(fields[6:6 + ndim])
    list_len, peer, lineno, name, mask, filename, function = fields[6 + _MAX_DIMS:]
    members = tuple(r for r in range(_MAX_RANKS) if mask[r // 8] >> (r % 8) & 1)
    dtype_name = str(DTYPES[dtype]).removeprefix("torch.") if dtype >= 0 else (
        "" if dtype == -1 else "other dtype")
    return LatestCall(rank, seq, group_seq, state, OPS[op], dtype_name, shape, list_len, peer,
                name.rstrip(b"\0").decode(errors="replace"), members,
                filename.rstrip(b"\0").decode(errors="replace"), lineno,
                function.rstrip(b"\0").decode(errors="replace"))
