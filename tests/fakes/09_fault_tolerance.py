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
    ],
}
