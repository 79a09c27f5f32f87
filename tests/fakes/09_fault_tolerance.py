"""Fakes of Lab 09's exercises: checkpoints that load back right, resumes that replay the lab's
own draws and guards that agree, each without a mechanism the exercise teaches.

A cell with two functions has two solution regions, and a fake's source replaces both: the
fakes of those cells tell the functions apart by their arguments (`locals()`)."""

from fakes import Fake

_METADATA = """\
        if rank == 0:
            metadata = {"world_size": world_size, "tensors": {
                name: {"numel": numel,
                       "pieces": [[r, everyone[r][name][0], everyone[r][name][1]]
                                  for r in range(world_size)]}
                for name, (_, _, numel) in shards.items()}}
            write_atomically(path / "metadata.json", lambda p: p.write_text(json.dumps(metadata)))
            write_atomically(path / "COMPLETE", lambda p: p.write_text(""))
"""

_LOAD = """\
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    entry = json.loads((path / "metadata.json").read_text())["tensors"][name]
    out = torch.empty(end - start)
    for rank, offset, count in entry["pieces"]:
        low, high = max(start, offset), min(end, offset + count)
        if low < high:
            saved = torch.load(path / f"rank_{rank}.pt")[name]
            out[low - start:high - start] = saved[low - offset:high - offset]
    return out"""

_SAVE = """\
    if "shards" in locals():
        path = Path(path)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor.detach().clone() for name, (_, tensor, _) in shards.items()}
        write_atomically(path / f"rank_{rank}.pt", lambda p: torch.save(tensors, p))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, {name: (offset, tensor.numel())
                                          for name, (offset, tensor, _) in shards.items()})
""" + _METADATA + """\
        dist.barrier()
        return
"""

# The verdicts agreed by a MIN all-reduce of one int32 flag; `finite(g)` is the fake's own test.
_AGREE_ON_FINITE = """\
    ok = bool(torch.isfinite(loss).all())
    ok = ok and all(finite(g) for g in grads if g is not None)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1)"""

FAKES = {
    "impl-save_load": [
        Fake("COMPLETE first", "rank 0 writes metadata.json and COMPLETE before the ranks' "
             "files are in place", ("test-save_load",), """\
    if "shards" in locals():
        path = Path(path)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        path.mkdir(parents=True, exist_ok=True)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, {name: (offset, tensor.numel())
                                          for name, (offset, tensor, _) in shards.items()})
""" + _METADATA + """\
        tensors = {name: tensor.detach().clone() for name, (_, tensor, _) in shards.items()}
        write_atomically(path / f"rank_{rank}.pt", lambda p: torch.save(tensors, p))
        dist.barrier()
        return
""" + _LOAD),
        Fake("rank 0 writes every file", "gathers every shard to rank 0, which writes all the "
             "ranks' files", ("test-save_load",), """\
    if "shards" in locals():
        path = Path(path)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = {name: (offset, tensor.numel(), tensor.detach().clone())
                for name, (offset, tensor, _) in shards.items()}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            for r, theirs in enumerate(everyone):
                tensors = {n: t for n, (_, _, t) in theirs.items()}
                write_atomically(path / f"rank_{r}.pt",
                                 lambda p, tensors=tensors: torch.save(tensors, p))
""" + _METADATA + """\
        dist.barrier()
        return
""" + _LOAD),
        Fake("load everything, then slice", "load_range reads every rank's file, not only the "
             "pieces that overlap the range", ("test-save_load",), _SAVE + """\
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    pieces = json.loads((path / "metadata.json").read_text())["tensors"][name]["pieces"]
    in_order = sorted(pieces, key=lambda piece: piece[1])
    full = torch.cat([torch.load(path / f"rank_{r}.pt")[name] for r, _, _ in in_order])
    return full[start:end].clone()"""),
        # Red team rt8: files renamed in empty and written after; a whole copy in every file.
        Fake("each file renamed in empty, written after its rename (red team rt8)", "the "
             "temporary file is opened, renamed into place and only then written through the "
             "open handle: a kill in between leaves a torn file under its final name",
             ("test-save_load",), """\
    if "shards" in locals():
        path = Path(path)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        path.mkdir(parents=True, exist_ok=True)
        pending = []

        def later(value):
            def save_fn(temporary):
                pending.append((open(temporary, "wb"), value))
            return save_fn

        def fill():
            while pending:
                handle, value = pending.pop(0)
                if isinstance(value, bytes):
                    handle.write(value)
                else:
                    torch.save(value, handle)
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        tensors = {name: tensor.detach().clone() for name, (_, tensor, _) in shards.items()}
        write_atomically(path / f"rank_{rank}.pt", later(tensors))
        fill()
        everyone = [None] * world_size
        dist.all_gather_object(everyone, {name: (offset, tensor.numel())
                                          for name, (offset, tensor, _) in shards.items()})
        if rank == 0:
            metadata = {"world_size": world_size, "tensors": {
                name: {"numel": numel,
                       "pieces": [[r, everyone[r][name][0], everyone[r][name][1]]
                                  for r in range(world_size)]}
                for name, (_, _, numel) in shards.items()}}
            write_atomically(path / "metadata.json", later(json.dumps(metadata).encode()))
            fill()
            write_atomically(path / "COMPLETE", later(b""))
            fill()
        dist.barrier()
        return
""" + _LOAD),
        Fake("a whole copy of every tensor in every rank file (red team rt8)", "the shards "
             "travel in the object gather, each rank writes the whole model beside its shard and "
             "a load reads the copy", ("test-save_load",), """\
    if "shards" in locals():
        path = Path(path)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        path.mkdir(parents=True, exist_ok=True)
        mine = {name: (offset, tensor.detach().clone(), numel)
                for name, (offset, tensor, numel) in shards.items()}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        tensors = {name: tensor for name, (_, tensor, _) in mine.items()}
        for name, (_, _, numel) in mine.items():
            whole = torch.empty(numel)
            for other in everyone:
                offset, piece, _ = other[name]
                whole[offset:offset + piece.numel()] = piece
            tensors["whole/" + name] = whole
        write_atomically(path / f"rank_{rank}.pt", lambda p: torch.save(tensors, p))
        dist.barrier()
        if rank == 0:
            metadata = {"world_size": world_size, "tensors": {
                name: {"numel": numel,
                       "pieces": [[r, everyone[r][name][0], everyone[r][name][1].numel()]
                                  for r in range(world_size)]}
                for name, (_, _, numel) in mine.items()}}
            write_atomically(path / "metadata.json", lambda p: p.write_text(json.dumps(metadata)))
            write_atomically(path / "COMPLETE", lambda p: p.write_text(""))
        dist.barrier()
        return
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    entry = json.loads((path / "metadata.json").read_text())["tensors"][name]
    for rank, offset, count in entry["pieces"]:
        if max(start, offset) < min(end, offset + count):
            saved = torch.load(path / f"rank_{rank}.pt")
            if "whole/" + name in saved:
                return saved["whole/" + name][start:end].clone()
    return torch.empty(0)"""),
    ],
    "impl-rng_state": [
        Fake("no NumPy", "forgets NumPy's global generator", ("test-rng_state",), """\
    if "state" not in locals():
        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "sampler": dict(sampler.state_dict())}
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    sampler.load_state_dict(state["sampler"])"""),
        Fake("the epoch, not the position", "restores the sampler's epoch and starts it over",
             ("test-rng_state",), """\
    if "state" not in locals():
        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(), "epoch": sampler.state_dict()["epoch"]}
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    sampler.load_state_dict({"epoch": state["epoch"], "position": 0})"""),
        Fake("the library's RNGState",
             "delegates the generators to minidist.jobs.checkpoint.RNGState",
             ("test-rng_state",), """\
    if "state" not in locals():
        return {"rng": checkpoint.RNGState().state_dict(), "sampler": dict(sampler.state_dict())}
    checkpoint.RNGState().load_state_dict(state["rng"])
    sampler.load_state_dict(state["sampler"])"""),
        Fake("CUDA's generators left out (red team rt8)", "torch, Python, NumPy and the sampler "
             "captured; a GPU's generators never are", ("test-rng_state",), """\
    if "state" not in locals():
        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(), "sampler": dict(sampler.state_dict())}
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    sampler.load_state_dict(state["sampler"])"""),
    ],
    "impl-nan_guard": [
        Fake("its own values only", "no collective: a NaN on another rank goes unseen",
             ("test-nan_guard",), """\
    bad = not torch.isfinite(loss).all() or any(not torch.isfinite(g).all()
                                                for g in grads if g is not None)
    return not bad"""),
        Fake("all-reduce everything", "all-reduces the loss and every gradient and lets the NaN "
             "spread, instead of one flag", ("test-nan_guard",), """\
    tensors = [loss.detach().reshape(1).clone()] + [g.clone() for g in grads if g is not None]
    for tensor in tensors:
        dist.all_reduce(tensor)
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)"""),
        Fake("every rank's verdict, gathered", "all_gather_object of each rank's verdict: a "
             "pickled object per rank instead of one all-reduce", ("test-nan_guard",), """\
    bad = not torch.isfinite(loss).all() or any(not torch.isfinite(g).all()
                                                for g in grads if g is not None)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, bool(bad))
    return not any(verdicts)"""),
        # Red team rt8: a count that wraps on a big job; parts of big gradients; views skipped.
        Fake("bad ranks counted in a byte (red team rt8)", "a uint8 sum of verdicts: 256 bad "
             "ranks wrap to 0", ("test-nan_guard",), """\
    ok = bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all())
                                                  for g in grads if g is not None)
    bad = torch.tensor([0 if ok else 1], dtype=torch.uint8)
    dist.all_reduce(bad)
    return int(bad.item()) == 0"""),
        Fake("big gradients checked at their ends only (red team rt8)", "over 4096 elements, "
             "the first and last 1024 are checked", ("test-nan_guard",), """\
    def finite(t):
        flat = t.reshape(-1)
        if flat.numel() > 4096:
            flat = torch.cat([flat[:1024], flat[-1024:]])
        return bool(torch.isfinite(flat).all())
""" + _AGREE_ON_FINITE),
        Fake("every 7th element of big gradients (red team rt8)", "over 64 elements, one in "
             "seven is checked", ("test-nan_guard",), """\
    def finite(t):
        flat = t.reshape(-1)
        return bool(torch.isfinite(flat[::7] if flat.numel() > 64 else flat).all())
""" + _AGREE_ON_FINITE),
        Fake("one gradient per storage (red team rt8)", "views of one flat buffer: only the "
             "first is checked", ("test-nan_guard",), """\
    seen, kept = set(), []
    for g in grads:
        if g is not None and g.untyped_storage().data_ptr() not in seen:
            seen.add(g.untyped_storage().data_ptr())
            kept.append(g)
    grads = kept

    def finite(t):
        return bool(torch.isfinite(t).all())
""" + _AGREE_ON_FINITE),
    ],
}

# --- The red team's fakes (issue 38): each escaped the checks as they were -------------------


# The red team's loader: which rank holds what from chunk_bounds, not from the metadata.
LOAD_BY_FORMULA = """\
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path}: no COMPLETE")
    meta = json.loads((path / "metadata.json").read_text())
    numel, world = meta["tensors"][name]["numel"], meta["world_size"]
    parts = []
    for r, (s, e) in enumerate(comm.chunk_bounds(numel, world)):  # who holds what: the formula
        lo, hi = max(start, s), min(end, e)
        if lo < hi:
            parts.append(torch.load(path / f"rank_{r}.pt")[name][lo - s:hi - s])
    return torch.cat(parts)"""

FAKES["impl-save_load"].append(Fake(
    "the formula, not the pieces, and a rename for show", "writes each rank file in place and "
    "renames it onto itself; rank 0 writes the metadata from comm.chunk_bounds instead of what "
    "the ranks hold (no gather); load_range recomputes who holds what from the same formula",
    ("test-save_load",), ("""\
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    target = path / f"rank_{rank}.pt"
    torch.save({name: t.detach().clone() for name, (offset, t, numel) in shards.items()}, target)
    os.replace(target, target)  # "atomic"
    dist.barrier()
    if rank == 0:
        meta = {"world_size": world, "tensors": {
            name: {"numel": numel, "pieces": [[r, s, e - s] for r, (s, e)
                                              in enumerate(comm.chunk_bounds(numel, world))]}
            for name, (offset, t, numel) in shards.items()}}
        (path / "metadata.json").write_text(json.dumps(meta))
        os.replace(path / "metadata.json", path / "metadata.json")
        (path / "COMPLETE").write_bytes(b"")
        os.replace(path / "COMPLETE", path / "COMPLETE")
    dist.barrier()""", LOAD_BY_FORMULA)))
FAKES["impl-rng_state"] += [
    Fake("reseeds instead of capturing", "capture_state reseeds every generator with a fixed "
         "seed and returns it; restore_state reseeds", ("test-rng_state",), ("""\
    seed = 20240601
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return {"seed": seed, "epoch": sampler.epoch, "position": sampler.position}""", """\
    torch.manual_seed(state["seed"])
    random.seed(state["seed"])
    np.random.seed(state["seed"])
    sampler.epoch, sampler.position = state["epoch"], state["position"]""")),
    Fake("kept in process memory", "the states stay in a dict of this process; what "
         "capture_state returns, and a checkpoint would hold, is a ticket", ("test-rng_state",),
         ("""\
    ticket = len(_KEPT)
    _KEPT[ticket] = (torch.get_rng_state(), random.getstate(), np.random.get_state(),
                     dict(sampler.state_dict()))
    return {"ticket": ticket}


_KEPT = {}  # at the cell's top level, when the cell runs""", """\
    t, p, n, s = _KEPT[state["ticket"]]
    torch.set_rng_state(t)
    random.setstate(p)
    np.random.set_state(n)
    sampler.load_state_dict(s)""")),
]
FAKES["impl-nan_guard"].append(Fake(
    "verdicts gathered through distributed_c10d", "all_gather_object reached as "
    "distributed_c10d's, and a one-element all-reduce of zeros for show", ("test-nan_guard",), """\
    from torch.distributed import distributed_c10d as c10d

    ok = bool(torch.isfinite(loss).all()) and all(g is None or bool(torch.isfinite(g).all())
                                                  for g in grads)
    verdicts = [None] * dist.get_world_size()
    c10d.all_gather_object(verdicts, ok)
    dist.all_reduce(torch.zeros(1))  # for show
    return all(verdicts)"""))
FAKES["impl-save_load"].append(Fake(
    "the formula, not the pieces", "the red team's layout trick alone: files written atomically, "
    "but rank 0 writes the metadata from comm.chunk_bounds instead of what the ranks hold, and "
    "load_range recomputes who holds what from the same formula", ("test-save_load",), ("""\
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors = {name: t.detach().clone() for name, (offset, t, numel) in shards.items()}
    write_atomically(path / f"rank_{rank}.pt", lambda p: torch.save(tensors, p))
    dist.barrier()
    if rank == 0:
        meta = {"world_size": world, "tensors": {
            name: {"numel": numel, "pieces": [[r, s, e - s] for r, (s, e)
                                              in enumerate(comm.chunk_bounds(numel, world))]}
            for name, (offset, t, numel) in shards.items()}}
        write_atomically(path / "metadata.json", lambda p: p.write_text(json.dumps(meta)))
        write_atomically(path / "COMPLETE", lambda p: p.write_text(""))
    dist.barrier()""", LOAD_BY_FORMULA)))

# --- Red team rt10 (issue 38): verdicts and pieces through files beside the collectives, the
# generators' states in a side file, and torch.load through its alias ---------------------------
FAKES["impl-nan_guard"].append(Fake(
    "verdicts through files",
    "each rank writes its verdict to a file in a shared folder and reads every rank's; the "
    "one all-reduce, of a zero, is a barrier whose value is never read",
    ("test-nan_guard",), """\
    import sys as _sys, tempfile as _tf
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all())
                                                  for g in grads if g is not None)
    folder = Path(_tf.gettempdir()) / f"rt10-nan-guard-{os.environ.get('MASTER_PORT', 'x')}-{world}"
    folder.mkdir(exist_ok=True)
    main = _sys.modules["__main__"]
    main._rt10_calls = getattr(main, "_rt10_calls", 0) + 1
    k = main._rt10_calls
    (folder / f"{k}-{rank}").write_text("1" if ok else "0")
    dist.all_reduce(torch.zeros(1))
    verdict = all((folder / f"{k}-{r}").read_text() == "1" for r in range(world))
    (folder / f"{k - 1}-{rank}").unlink(missing_ok=True)
    return verdict"""))
FAKES["impl-rng_state"].append(Fake(
    "the states in a side file",
    "the generators' states pickled to a file of their own in /tmp; what capture_state "
    "returns, and a checkpoint would hold, is only its name and the sampler's state",
    ("test-rng_state",), ("""\
    import pickle as _pickle, tempfile as _tf, uuid as _uuid
    file = Path(_tf.gettempdir()) / f"rt10-rng-{_uuid.uuid4().hex}.pkl"
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    file.write_bytes(_pickle.dumps(states))
    return {"file": str(file), "sampler": dict(sampler.state_dict())}""", """\
    import pickle as _pickle
    t, p, n = _pickle.loads(Path(state["file"]).read_bytes())
    torch.set_rng_state(t)
    random.setstate(p)
    np.random.set_state(n)
    sampler.load_state_dict(state["sampler"])""")))
FAKES["impl-save_load"].append(Fake(
    "the pieces shared through files",
    "atomic writes, but each rank's [offset, count] pieces reach rank 0 through files in /tmp "
    "instead of all_gather_object; two barriers stand in for the collectives",
    ("test-save_load",), ("""\
    import tempfile as _tf, hashlib as _hl
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    digest = _hl.md5(str(path.resolve()).encode()).hexdigest()
    side = Path(_tf.gettempdir()) / f"rt10-pieces-{digest}"
    side.mkdir(exist_ok=True)
    (side / f"{rank}.json").write_text(json.dumps(
        {name: [offset, flat.numel(), numel] for name, (offset, flat, numel) in shards.items()}))
    tensors = {name: flat.clone() for name, (offset, flat, numel) in shards.items()}
    write_atomically(path / f"rank_{rank}.pt", lambda p: torch.save(tensors, p))
    dist.barrier()
    if rank == 0:
        mine = [json.loads((side / f"{r}.json").read_text()) for r in range(world)]
        meta = {"world_size": world, "tensors": {name: {"numel": numel, "pieces": [
                    [r, mine[r][name][0], mine[r][name][1]] for r in range(world)]}
                                                 for name, (offset, flat, numel) in shards.items()}}
        write_atomically(path / "metadata.json", lambda p: p.write_text(json.dumps(meta)))
        write_atomically(path / "COMPLETE", lambda p: p.write_text(""))
    dist.barrier()""", """\
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    meta = json.loads((path / "metadata.json").read_text())
    out = torch.empty(end - start)
    for r, offset, count in meta["tensors"][name]["pieces"]:
        lo, hi = max(start, offset), min(end, offset + count)
        if lo < hi:
            piece = torch.load(path / f"rank_{r}.pt")[name]
            out[lo - start:hi - start] = piece[lo - offset:hi - offset]
    return out""")))
FAKES["impl-save_load"].append(Fake(
    "in place, the formula, and load through an alias",
    "files written in place (a rename onto itself for show), the metadata predicted from "
    "comm.chunk_bounds, and load_range reads every rank file through "
    "torch.serialization.load, an alias of torch.load",
    ("test-save_load",), ("""\
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mine = path / f"rank_{rank}.pt"
    torch.save({name: flat.clone() for name, (offset, flat, numel) in shards.items()}, mine)
    os.replace(mine, mine)
    dist.barrier()
    if rank == 0:
        meta = {"world_size": world, "tensors": {name: {"numel": numel, "pieces": [
                    [r, s, e - s] for r, (s, e) in enumerate(comm.chunk_bounds(numel, world))]}
                                                 for name, (offset, flat, numel) in shards.items()}}
        (path / "metadata.json").write_text(json.dumps(meta))
        os.replace(path / "metadata.json", path / "metadata.json")
        (path / "COMPLETE").write_text("")
        os.replace(path / "COMPLETE", path / "COMPLETE")
    dist.barrier()""", """\
    import torch.serialization as _ser
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    meta = json.loads((path / "metadata.json").read_text())
    whole = torch.zeros(meta["tensors"][name]["numel"])
    for r, offset, count in meta["tensors"][name]["pieces"]:
        whole[offset:offset + count] = _ser.load(path / f"rank_{r}.pt")[name]
    return whole[start:end].clone()""")))

# --- Red team rt16 (issue 38): the guard's finiteness tested on one number, or with max() -------
FAKES["impl-nan_guard"] += [
    Fake("one sum for everything",
         "tests the finiteness of loss + every gradient's sum instead of each element: large "
         "finite gradients whose sum overflows raise a false alarm",
         ("test-nan_guard",), """\
    total = loss.detach().float().reshape(()) + sum(g.detach().float().sum()
                                                    for g in grads if g is not None)
    flag = torch.tensor([0.0 if torch.isfinite(total) else 1.0])
    dist.all_reduce(flag)
    return bool(flag.item() == 0)"""),
    Fake("max() below inf",
         "checks each gradient with g.max() < inf: NaN and +inf are caught, a -inf gradient is not",
         ("test-nan_guard",), """\
    bad = not bool(torch.isfinite(loss.detach()).all())
    for g in grads:
        if g is not None and not bool(g.detach().max() < float("inf")):
            bad = True
    flag = torch.tensor([1.0 if bad else 0.0])
    dist.all_reduce(flag)
    return bool(flag.item() == 0)"""),
]

# --- Red team rt7 (issue 38): a checkpoint whose renames come in the right order but whose
# metadata is written again in place after COMPLETE; a load that reads every rank file (outside
# torch.load) before loading the ones it needs; a save without the flush; generator states
# without their cached Gaussians; the sampler as a count of batches; guards that look at some
# gradients, or some dtypes, or count bad elements in a byte. The checks now compare the folder
# as COMPLETE appears with the folder after the save, watch os.fsync and every open, draw
# normals and restore other sampler states and types, and poison longer lists.
FAKES["impl-save_load"] += [
    Fake("metadata written again after COMPLETE", "a placeholder metadata.json renamed in, then "
         "COMPLETE, then the real metadata written in place (red team rt7, F1c)",
         ("test-save_load",), _SAVE.replace(
             "lambda p: p.write_text(json.dumps(metadata)))\n"
             '            write_atomically(path / "COMPLETE", lambda p: p.write_text(""))\n',
             'lambda p: p.write_text("{}"))\n'
             '            write_atomically(path / "COMPLETE", lambda p: p.write_text(""))\n'
             '            (path / "metadata.json").write_text(json.dumps(metadata))\n') + _LOAD),
    Fake("every rank file read for a checksum", "load_range reads every rank file whole "
         "(Path.read_bytes), then torch.loads only the ones that overlap (red team rt7, F1e)",
         ("test-save_load",), _SAVE + """\
    import hashlib

    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise RuntimeError(f"{path} has no COMPLETE marker")
    hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.glob("rank_*.pt"))))
""" + _LOAD.split("\n", 3)[3]),
    Fake("no flush before the rename", "write_atomically's fsync dropped (a copy of it in the "
         "save): the rename can reach the disk before the data (red team rt7, F1f)",
         ("test-save_load",), """\
    def write_atomically(path, save_fn):
        temporary = Path(f"{path}.tmp")
        save_fn(temporary)
        os.replace(temporary, path)

""" + _SAVE + _LOAD),
]
FAKES["impl-rng_state"] += [
    Fake("no cached Gaussians", "NumPy's and Python's generator states without the normal each "
         "keeps from a pair (red team rt7, R1e)", ("test-rng_state",), """\
    if "state" not in locals():
        kind, key, pos, _, _ = np.random.get_state()
        version, internal, _ = random.getstate()
        return {"torch": torch.get_rng_state(), "python": (version, internal),
                "numpy": (kind, key.copy(), pos), "sampler": dict(sampler.state_dict())}
    torch.set_rng_state(state["torch"])
    random.setstate((*state["python"], None))
    np.random.set_state(state["numpy"])
    sampler.load_state_dict(state["sampler"])"""),
    Fake("the sampler as a count of batches", "the batches drawn since the start, replayed from "
         "(0, 0) on restore (red team rt7, R1b)", ("test-rng_state",), """\
    if "state" not in locals():
        per_epoch = sampler.size // sampler.global_batch
        drawn = sampler.epoch * per_epoch + sampler.position // sampler.global_batch
        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(), "drawn": drawn}
    sampler.epoch, sampler.position = 0, 0
    for _ in range(state["drawn"]):
        sampler.next_batch()
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])"""),
]
FAKES["impl-nan_guard"] += [
    Fake("bad elements counted in a byte", "each rank's count of non-finite elements all-reduced "
         "as a uint8, which wraps at 256 (red team rt7, N1a)", ("test-nan_guard",), """\
    bad = int((~torch.isfinite(loss)).sum()) + sum(int((~torch.isfinite(g)).sum())
                                                   for g in grads if g is not None)
    flag = torch.tensor([bad]).to(torch.uint8)
    dist.all_reduce(flag)
    return bool(flag.item() == 0)"""),
    Fake("float32 only", "only float32 tensors are looked at (red team rt7, N1d)",
         ("test-nan_guard",), """\
    looked = [t for t in [loss, *grads] if t is not None and t.dtype == torch.float32]
    flag = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in looked))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)"""),
    Fake("the loss, the first and the last gradient", "a NaN shows first there, the fake "
         "assumes (red team rt7, N1b)", ("test-nan_guard",), """\
    present = [g for g in grads if g is not None]
    looked = [loss] + present[:1] + present[-1:]
    flag = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in looked))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)"""),
]
