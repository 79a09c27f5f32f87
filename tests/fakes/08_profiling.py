"""Fakes of Lab 08's exercises: the right numbers on the lab's own profiles and runs, without
the arithmetic each exercise teaches (the library's, raw events, compute as one span; means, the
all-reduce's waiting, a vote per step), and a mismatch check that lets some mismatches through.

A cell with two functions has two solution regions, and a fake's source replaces both: the
fakes of those cells tell the functions apart by their arguments (`locals()`)."""

from fakes import Alternative, Fake, edited, solution_region, stripped_clone_helpers

# The first function of the cell, `merge`, written as the lab asks: fakes of `overlap_fraction`
# alone keep it right, so that only the second function is what they fake.
_MERGE_RIGHTLY = """\
    if "timeline" not in locals():
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged
"""

FAKES = {
    "impl-overlap": [
        Fake("the library's overlap", "writes no interval arithmetic: profiling.merge and "
             "profiling.overlap_fraction", ("test-overlap",), """\
    if "timeline" not in locals():
        return profiling.merge(intervals)
    return profiling.overlap_fraction(timeline)[rank]"""),
        Fake("every pair of raw events", "no union per kind: events of one kind that overlap "
             "each other are counted twice", ("test-overlap",), _MERGE_RIGHTLY + """\
    mine = [e for e in timeline.events if e.rank == rank]
    communication = [(e.start, e.end) for e in mine if e.kind == "communication"]
    compute = [(e.start, e.end) for e in mine if e.kind == "compute"]
    total = sum(end - start for start, end in communication)
    hidden = sum(max(0.0, min(c_end, p_end) - max(c_start, p_start))
                 for c_start, c_end in communication for p_start, p_end in compute)
    return hidden / total if total > 0 else 0.0"""),
        Fake("compute as one span", "takes the rank's compute as one block from its first "
             "operator to its last: the gaps between operators hide communication too",
             ("test-overlap",), _MERGE_RIGHTLY + """\
    mine = [e for e in timeline.events if e.rank == rank]
    communication = union((e.start, e.end) for e in mine if e.kind == "communication")
    compute = [(e.start, e.end) for e in mine if e.kind == "compute"]
    if not communication or not compute:
        return 0.0
    first, last = min(start for start, _ in compute), max(end for _, end in compute)
    total = sum(end - start for start, end in communication)
    hidden = sum(max(0.0, min(end, last) - max(start, first)) for start, end in communication)
    return hidden / total"""),
    ],
    "impl-straggler": [
        Fake("mean compute", "means instead of medians: one hiccup decides",
             ("test-straggler",), """\
    def mean(values):
        return sum(values) / len(values)

    return max(per_rank, key=lambda rank: mean(per_rank[rank]["compute"]))"""),
        Fake("least time in the all-reduce", "reads the all-reduce's waiting instead of compute: "
             "right while links are equal", ("test-straggler",), """\
    def median(values):
        return sorted(values)[len(values) // 2]

    return min(per_rank, key=lambda rank: median(per_rank[rank]["all_reduce"]))"""),
        Fake("slowest most often", "a vote: the rank that computes slowest at the most steps, "
             "right while the straggler is the slowest at most steps", ("test-straggler",), """\
    steps = len(next(iter(per_rank.values()))["compute"])
    slowest = [max(per_rank, key=lambda rank: per_rank[rank]["compute"][step])
               for step in range(steps)]
    return max(per_rank, key=slowest.count)"""),
        Fake("the harmonic mean of compute (red team rt8)", "a statistic that shrugs off slow "
             "hiccups but not fast ones, in place of the median", ("test-straggler",), """\
    def typical(values):
        values = [v for v in values if v > 0]
        return len(values) / sum(1 / v for v in values) if values else 0.0
    return max(per_rank, key=lambda r: typical(per_rank[r]["compute"]))"""),
    ],
    "impl-checked-collective": [
        Fake("its own call only", "exchanges nothing: checks its own tensor and runs the "
             "collective, so a mismatch goes through", ("test-checked-collective",), """\
    if not tensor.is_contiguous():
        raise RuntimeError(f"rank {dist.get_rank()}: {op} needs a contiguous tensor")
    return collective(tensor)"""),
        Fake("rank 0 decides alone", "gathers the calls to rank 0 only: rank 0 raises while "
             "the other ranks run the collective", ("test-checked-collective",), """\
    mine = (op, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    calls = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, calls, dst=0)
    if dist.get_rank() == 0 and any(call != mine for call in calls):
        described = "; ".join(f"rank {r}: {o} {shape} {dtype}"
                              for r, (o, shape, dtype) in enumerate(calls))
        raise RuntimeError(f"mismatched collectives: {described}")
    return collective(tensor)"""),
        Fake("operation and shape only", "compares operations and shapes but not dtypes: the "
             "visible cases never differ in dtype", ("test-checked-collective",), """\
    mine = (op, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    calls = [None] * dist.get_world_size()
    dist.all_gather_object(calls, mine)
    if any(call[:2] != mine[:2] for call in calls):
        described = "; ".join(f"rank {r}: {o} {shape} {dtype}"
                              for r, (o, shape, dtype) in enumerate(calls))
        raise RuntimeError(f"mismatched collectives: {described}")
    return collective(tensor)"""),
        # Red team rt8: the calls exchanged, then compared in part.
        Fake("only ranks 0 and 1 compared (red team rt8)", "a mismatch on any other rank runs "
             "the collective", ("test-checked-collective",), edited(
                 solution_region("08_profiling", "impl-checked-collective"),
                 ("if any(call != mine for call in calls):", "if calls[0] != calls[1]:"))),
        Fake("dtypes compared by kind, not width (red team rt8)", "float32 matches float64 and "
             "int32 int64", ("test-checked-collective",), edited(
                 solution_region("08_profiling", "impl-checked-collective"),
                 ("if any(call != mine for call in calls):",
                  "if any((o, s, d.rstrip('0123456789')) != (mine[0], mine[1], "
                  "mine[2].rstrip('0123456789')) for o, s, d in calls):"))),
    ],
}


# The red team's fakes (issue 38), written from the student notebook and deck alone.
FAKES["impl-overlap"] += [
    Fake("the library's code under other names",
         "writes no interval arithmetic: profiling.merge, total and intersect, their code "
         "objects cloned under other names when the cell runs (before any check refuses them) "
         "and wired to each other through a copy of the module's globals", ("test-overlap",), (
             """    return _lib["merge"](intervals)""",
             """    def of(kind):
        return [(e.start, e.end) for e in timeline.events if e.rank == rank and e.kind == kind]
    communication = _lib["total"](of("communication"))
    hidden = _lib["total"](_lib["intersect"](of("communication"), of("compute")))
    return hidden / communication if communication > 0 else 0.0


import types

_lib = dict(vars(profiling))


def _clone(function, name):
    return types.FunctionType(function.__code__.replace(co_name=name), _lib, name)


_lib["merge"] = _clone(profiling.merge, "_merge")
_lib["total"] = _clone(profiling.total, "_total")
_lib["intersect"] = _clone(profiling.intersect, "_intersect")""")),
]
FAKES["impl-checked-collective"] += [
    Fake("bytes per element instead of the dtype",
         "compares operations, shapes and element sizes: blind to float16 against bfloat16 "
         "and int32 against float32", ("test-checked-collective",), """\
    mine = (op, list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
            tensor.element_size())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len({(o, tuple(s), size) for o, s, d, size in everyone}) > 1:
        raise RuntimeError("mismatched collective: " + "; ".join(
            f"rank {r}: {o} {s} {d}" for r, (o, s, d, _) in enumerate(everyone)))
    return collective(tensor)"""),
]
FAKES["impl-overlap"] += [
    Fake("the library's interval code cloned without its marks",
         "writes no interval arithmetic: profiling.merge, total and intersect cloned when the "
         "cell runs with every mark of their origin stripped (name, place, docstring, locals' "
         "names, line table)", ("test-overlap",), (
             """    return _merge(intervals)""",
             """    def of(kind):
        return _merge((e.start, e.end) for e in timeline.events
                      if e.rank == rank and e.kind == kind)
    communication = _total(of("communication"))
    hidden = _total(_intersect(of("communication"), of("compute")))
    return hidden / communication if communication > 0 else 0.0

""" + stripped_clone_helpers() + """
_merge = _stripped(profiling.merge)
_total = _stripped(profiling.total, merge=_merge)
_intersect = _stripped(profiling.intersect, merge=_merge)""")),
]
FAKES["impl-checked-collective"] += [
    Fake("the calls through the rendezvous store",
         "exchanges nothing through torch.distributed: each rank writes its call to the "
         "process group's key-value store and reads the others' back; one all_gather_object "
         "of None for show", ("test-checked-collective",), """\
    store = dist.distributed_c10d._get_default_store()
    rank, size = dist.get_rank(), dist.get_world_size()
    turn = store.add(f"turn/{rank}", 1)
    mine = f"rank {rank}: {op} {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    store.set(f"call/{turn}/{rank}", mine)
    calls = [store.get(f"call/{turn}/{r}").decode() for r in range(size)]
    dist.all_gather_object([None] * size, None)  # for show
    if len({call.split(": ", 1)[1] for call in calls}) > 1:
        raise RuntimeError("the ranks called different collectives: " + "; ".join(calls))
    return collective(tensor)"""),
]

# Red team rt13 (issue 38), written from the student notebook and deck alone.
FAKES["impl-overlap"] += [
    Fake("the library's interval code, its source tweaked",
         "writes no interval arithmetic: profiling.merge, total and intersect exec'd from their "
         "own source with one harmless statement added to each body, so their instructions "
         "differ from the refused originals'", ("test-overlap",), (
             """\
    global _LIB_COPY
    if "_LIB_COPY" not in globals():
        import inspect as _inspect, textwrap as _textwrap
        from minidist.jobs import profiling as _prof
        _LIB_COPY = dict(vars(_prof))  # the module's globals, then the copies
        for _f in (_prof.merge, _prof.total, _prof.intersect):
            _lines = _textwrap.dedent(_inspect.getsource(_f)).split("\\n")
            _lines.insert(2, "    _unused = 0")  # after the def line and the one-line docstring
            exec(compile("\\n".join(_lines), "<mine>", "exec"), _LIB_COPY)
    return [tuple(pair) for pair in _LIB_COPY["merge"](intervals)]""",
             """\
    union([])  # builds the copies
    mine = [e for e in timeline.events if e.rank == rank]
    comm = [(e.start, e.end) for e in mine if e.kind == "communication"]
    comp = [(e.start, e.end) for e in mine if e.kind == "compute"]
    length = _LIB_COPY["total"](comm)
    if length <= 0:
        return 0.0
    return float(_LIB_COPY["total"](_LIB_COPY["intersect"](comm, comp)) / length)""")),
]
FAKES["impl-straggler"] += [
    Fake("the middle key", "every example shown has three ranks with the straggler in the "
         "middle: returns the middle rank", ("test-straggler",), """\
    ranks = sorted(per_rank)
    return ranks[len(ranks) // 2]"""),
    Fake("the slowest fastest step", "compares each rank's fastest (minimum) compute step, "
         "immune to hiccups but not a median", ("test-straggler",), """\
    return max(per_rank, key=lambda r: min(per_rank[r]["compute"]))"""),
]
FAKES["impl-checked-collective"] += [
    Fake("the calls through files",
         "exchanges nothing through torch.distributed: each rank writes its call to a file "
         "of its own, dist.barrier() syncs the ranks (the torch.distributed call the check sees), "
         "then every rank reads every file", ("test-checked-collective",), """\
    import os as _os
    _rank, _world = dist.get_rank(), dist.get_world_size()
    _counter = globals().setdefault("_CC_COUNTER", [0])
    _counter[0] += 1
    _dir = f".rt13_cc_{_os.getppid()}_{_counter[0]}"
    _os.makedirs(_dir, exist_ok=True)
    mine = f"rank {_rank}: {op} {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    with open(f"{_dir}/{_rank}", "w") as fh:
        fh.write(mine)
    dist.barrier()
    calls = [open(f"{_dir}/{r}").read() for r in range(_world)]
    dist.barrier()
    if len({c.split(": ", 1)[1] for c in calls}) > 1:
        raise RuntimeError("mismatched collective: " + "; ".join(calls))
    return collective(tensor)"""),
    Fake("the calls read up the stack",
         "exchanges nothing it uses: every rank's call is read from a caller's frame (the "
         "check's `calls`); an all_gather_object of the rank number runs for show",
         ("test-checked-collective",), """\
    import sys as _sys
    _frame, _calls = _sys._getframe(1), None
    while _frame is not None and _calls is None:
        _c = _frame.f_locals.get("calls")
        if isinstance(_c, (list, tuple)) and _c and isinstance(_c[0], tuple):
            _calls = _c
        _frame = _frame.f_back
    _box = [None] * dist.get_world_size()
    dist.all_gather_object(_box, dist.get_rank())
    if _calls is None:  # nobody to compare with: run it
        return collective(tensor)
    described = [f"rank {r}: {o} {list(s)} {str(d).removeprefix('torch.')}"
                 for r, (o, s, d) in enumerate(_calls)]
    if len(set((o, tuple(s), d) for o, s, d in _calls)) > 1:
        raise RuntimeError("mismatched collective: " + "; ".join(described))
    return collective(tensor)"""),
]

# A correct answer the spec allows: the exchange goes through rank 0 (a gather, then a broadcast
# of every call), so the hidden check that alters a fingerprint on its way must not need an
# all_gather_object.
ALTERNATIVES = {
    "impl-checked-collective": [
        Alternative("rank 0 gathers, then broadcasts every call",
                    "gathers the calls to rank 0 and broadcasts the list back: every rank learns "
                    "every call through the exchange, as with one all_gather_object",
                    ("test-checked-collective",), """\
    mine = (op, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    calls = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, calls, dst=0)
    box = [calls]
    dist.broadcast_object_list(box, src=0)
    calls = box[0]
    if any(call != calls[0] for call in calls):
        described = "; ".join(f"rank {r}: {o} {shape} {dtype}"
                              for r, (o, shape, dtype) in enumerate(calls))
        raise RuntimeError(f"mismatched collectives: {described}")
    return collective(tensor)"""),
    ],
}

# Red team rt19 (issue 38): the library's overlap of the lab's two real profiles worked out when
# the cell runs (before any check refuses it) and looked up by the timeline's id; sympy's interval
# sets (Union, Intersection, measure) for every made-up timeline, fast enough on a handful of
# events. (The red team's table went at module level after the function, as here.)
FAKES["impl-overlap"] += [
    Fake("the real profiles cached, sympy for the rest",
         "red team rt19: profiling.overlap_fraction of ddp_flat and ddp_buckets computed when the "
         "cell runs, keyed by id(timeline); made-up timelines through sympy's set algebra",
         ("test-overlap",), (
             """\
    import sympy
    if not intervals:
        return []
    u = sympy.Union(*[sympy.Interval(s, e) for s, e in intervals])
    parts = u.args if isinstance(u, sympy.Union) else (u,)
    num = lambda x: int(x) if x.is_Integer else float(x)  # noqa: E731
    return sorted((num(i.start), num(i.end)) for i in parts if not i.is_empty)""",
             """\
    import sympy
    if id(timeline) in _KNOWN:
        return _KNOWN[id(timeline)][rank]
    def mine(kind):
        return sympy.Union(*[sympy.Interval(e.start, e.end) for e in timeline.events
                             if e.rank == rank and e.kind == kind])
    comm = mine("communication")
    if comm.is_empty or comm.measure == 0:
        return 0.0
    return float(sympy.Intersection(comm, mine("compute")).measure / comm.measure)


_KNOWN = {id(t): profiling.overlap_fraction(t) for t in (ddp_flat, ddp_buckets)}""")),
]

# --- Red team rt7 (issue 38): straggler rules fitted to the checks' timings (compute against
# the all-reduce's waiting), and checked collectives that compare too little (an operation's
# family, shapes with their 1s squeezed out). The checks now have a straggler on a slow link
# and calls that differ in a dimension of size 1 or in the operation within a family.
_MEDIAN = """\
    def median(values):
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

"""
FAKES["impl-straggler"] += [
    Fake("compute over the all-reduce's waiting", "medians of compute divided by medians of "
         "all-reduce time (red team rt7)", ("test-straggler",), _MEDIAN + """\
    return max(per_rank, key=lambda rank: median(per_rank[rank]["compute"])
               / max(median(per_rank[rank]["all_reduce"]), 1e-9))"""),
    Fake("compute less the all-reduce's waiting", "median compute minus median all-reduce time "
         "(red team rt7)", ("test-straggler",), _MEDIAN + """\
    return max(per_rank, key=lambda rank: median(per_rank[rank]["compute"])
               - median(per_rank[rank]["all_reduce"]))"""),
]
_CHECKED = """\
    mine = (op, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    calls = [None] * dist.get_world_size()
    dist.all_gather_object(calls, mine)
    if len({{{key} for o, s, d in calls}}) > 1:
        raise RuntimeError("mismatched collectives: " + "; ".join(
            f"rank {{r}}: {{o}} {{s}} {{d}}" for r, (o, s, d) in enumerate(calls)))
    return collective(tensor)"""
FAKES["impl-checked-collective"] += [
    Fake("the operation's family only", "compares op.split('_')[0]: all_reduce against "
         "all_gather goes through (red team rt7)", ("test-checked-collective",),
         _CHECKED.format(key='(o.split("_")[0], tuple(s), d)')),
    Fake("shapes with their 1s squeezed out", "(4,) and (1, 4) compare equal (red team rt7)",
         ("test-checked-collective",),
         _CHECKED.format(key="(o, tuple(x for x in s if x != 1), d)")),
]
