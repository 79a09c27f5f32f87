"""Fakes of Lab 13's exercises: each gets the numbers right (or close) without the mechanism the
exercise is about, or hands the work to the library's own version."""

from fakes import Alternative, Fake, stripped_clone_helpers

FAKES = {
    "impl-merge": [
        Fake("averages the partial results",
             "weights each partial output by its share of the exponentials: averages them and "
             "keeps the larger log-sum-exp",
             checked_by=("test-merge",),
             source="""    return (out1 + out2) / 2, torch.maximum(lse1, lse2)"""),
        Fake("exponentiates the log-sum-exps",
             "the max-subtraction (log-sum-exp) that keeps large scores finite: right for small "
             "scores, inf/nan once a score passes ~88 in fp32",
             checked_by=("test-merge",),
             source="""    total = lse1.exp() + lse2.exp()
    weighted = out1 * lse1.exp().unsqueeze(-1) + out2 * lse2.exp().unsqueeze(-1)
    return weighted / total.unsqueeze(-1), total.log()"""),
        Fake("calls the library",
             "writes no merge: delegates to context_parallel.merge_partials",
             checked_by=("test-merge",),
             source="""    return context_parallel.merge_partials(out1, lse1, out2, lse2)"""),
        Fake("a private copy of the library",
             "writes no merge: loads context_parallel.py again with runpy and calls its "
             "merge_partials (not the refused function object)",
             checked_by=("test-merge",),
             source="""    import runpy
    copy = runpy.run_path(context_parallel.__file__, run_name="cp_copy")
    return copy["merge_partials"](out1, lse1, out2, lse2)"""),
    ],
    "impl-ring-forward": [
        Fake("all-gathers every key and value",
             "the ring: gathers the whole sequence's keys and values on every rank, then "
             "attends block by block (right numbers, every rank holds all of K and V, nothing "
             "goes point to point to the right neighbour)",
             checked_by=("test-ring-forward",),
             source="""    keys = collectives.all_gather_along(k, 2, group=group)
    values = collectives.all_gather_along(v, 2, group=group)
    n = q.shape[2]
    for source in range(size):
        part = slice(source * n, (source + 1) * n)
        if causal and source > rank:
            continue
        found = context_parallel.block_attention(q, keys[:, :, part], values[:, :, part],
                                                 diagonal=causal and source == rank)
        out, lse = context_parallel.merge_partials(out, lse, *found)"""),
        Fake("waits for each block before computing",
             "the overlap: computes with the block it holds, then sends it on and waits, so no "
             "transfer is in flight while attention is computed (right numbers and bytes)",
             checked_by=("test-ring-forward",),
             source="""    for step in range(size):
        source = (rank - step) % size
        if not causal or source <= rank:
            found = context_parallel.block_attention(q, block[0], block[1],
                                                     diagonal=causal and source == rank)
            out, lse = context_parallel.merge_partials(out, lse, *found)
        if step < size - 1:
            block = collectives.shift(block, group=group, when="forward")"""),
        Fake("calls the library",
             "writes no ring: delegates to context_parallel.ring_forward",
             checked_by=("test-ring-forward",),
             source="""\
    out, lse = context_parallel.ring_forward(q, k, v, causal=causal, group=group)"""),
        Fake("collects the blocks, then attends once",
             "the online softmax: the blocks go round the ring (with a decoy block of "
             "attention each step, so the timeline looks right), then the rank attends to all "
             "the keys it collected at once, holding every block",
             checked_by=("test-ring-forward",),
             source="""    blocks = {}
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="forward", async_op=True)
        blocks[source] = block
        if not causal or source <= rank:  # a decoy, for the timeline
            context_parallel.block_attention(q, block[0], block[1],
                                             diagonal=causal and source == rank)
        if travelling is not None:
            block = travelling.wait()
    seen = [s for s in range(size) if not causal or s <= rank]
    keys = torch.cat([blocks[s][0] for s in seen], dim=2)
    values = torch.cat([blocks[s][1] for s in seen], dim=2)
    n = q.shape[2]
    scores = q @ keys.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        mine = torch.arange(rank * n, (rank + 1) * n)
        theirs = torch.cat([torch.arange(s * n, (s + 1) * n) for s in seen])
        scores = scores.masked_fill(mine[:, None] < theirs[None, :], float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.softmax(scores, -1) @ values"""),
        Fake("the library's private helpers",
             "writes no ring: runs the library's private _plan and _ring_forward, which "
             "ring_forward itself calls",
             checked_by=("test-ring-forward",),
             source="""    tensors = {"q": q, "k": k, "v": v}
    plan = context_parallel._plan(tensors, causal, group, "contiguous", "ring_forward")
    out, lse = context_parallel._ring_forward(plan, q, k, v, causal)"""),
    ],
    "impl-ring-backward": [
        Fake("autograd over all-gathered keys and values",
             "the ring: all-gathers K and V, lets autograd differentiate attention of the "
             "rank's queries over the whole sequence, and reduce-scatters the K and V "
             "gradients to their owners (right numbers; nothing travels with its block)",
             checked_by=("test-ring-backward",),
             source="""    n = q.shape[2]
    keys = collectives.all_gather_along(k.float(), 2, group=group).detach().requires_grad_()
    values = collectives.all_gather_along(v.float(), 2, group=group).detach().requires_grad_()
    queries = q.float().detach().requires_grad_()
    scores = queries @ keys.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        mine = torch.arange(rank * n, (rank + 1) * n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(size * n).unsqueeze(0) > mine, float("-inf"))
    (scores.softmax(-1) @ values).backward(grad_out.float())
    grad_k = collectives.reduce_scatter_along(keys.grad, 2, group=group)
    grad_v = collectives.reduce_scatter_along(values.grad, 2, group=group)
    return queries.grad.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)"""),
        Fake("brings the gradients home by an all-reduce",
             "the gradients' journey with their blocks: the key/value blocks go around the "
             "ring and each share is computed there, but into a buffer of the whole "
             "sequence's K and V gradients, all-reduced at the end (right numbers, more bytes "
             "than the ring from cp = 4 on)",
             checked_by=("test-ring-backward",),
             source="""    n, scale = q.shape[2], q.shape[-1] ** -0.5
    queries, grad_out32 = q.float(), grad_out.float()
    delta = (grad_out32 * out.float()).sum(-1, keepdim=True)
    grad_q = torch.zeros_like(queries)
    every = torch.zeros(2, *q.shape[:2], size * n, q.shape[3])  # all blocks' dK, dV
    for step in range(size):
        source = (rank - step) % size
        if not causal or source <= rank:
            keys, values = block[0].float(), block[1].float()
            scores = queries @ keys.transpose(-2, -1) * scale
            if causal and source == rank:
                hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            probs = (scores - lse.float().unsqueeze(-1)).exp()
            grad_scores = probs * (grad_out32 @ values.transpose(-2, -1) - delta)
            grad_q += grad_scores @ keys * scale
            rows = slice(source * n, (source + 1) * n)
            every[0][:, :, rows] += grad_scores.transpose(-2, -1) @ queries * scale
            every[1][:, :, rows] += probs.transpose(-2, -1) @ grad_out32
        if step < size - 1:
            block = collectives.shift(block, group=group, when="backward")
    collectives.all_reduce(every, op="sum", group=group)
    home = every[:, :, :, rank * n:(rank + 1) * n]
    return grad_q.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)"""),
        Fake("computes in the inputs' dtype",
             "fp32 accumulation: the ring and the gradients' journey are right, but every "
             "product and sum runs in the inputs' dtype (right in fp32, off by percents in "
             "bf16)",
             checked_by=("test-ring-backward",),
             source="""    scale = q.shape[-1] ** -0.5
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_q = torch.zeros_like(q)
    arriving = None
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="backward", async_op=True)
        grads = torch.zeros_like(block)
        if not causal or source <= rank:
            scores = q @ block[0].transpose(-2, -1) * scale
            if causal and source == rank:
                hidden = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            probs = (scores - lse.to(q.dtype).unsqueeze(-1)).exp()
            grads[1] = probs.transpose(-2, -1) @ grad_out
            grad_scores = probs * (grad_out @ block[1].transpose(-2, -1) - delta)
            grad_q += grad_scores @ block[0] * scale
            grads[0] = grad_scores.transpose(-2, -1) @ q * scale
        if arriving is not None:
            grads += arriving.wait()
        arriving = collectives.shift(grads, group=group, when="backward", async_op=True)
        if travelling is not None:
            block = travelling.wait()
    home = arriving.wait()
    return grad_q, home[0], home[1]"""),
        Fake("calls the library",
             "writes no backward: delegates to context_parallel.ring_backward",
             checked_by=("test-ring-backward",),
             source="""    found = (q, k, v, out, lse, grad_out)
    return context_parallel.ring_backward(*found, causal=causal, group=group)"""),
        Fake("autograd over the blocks the ring collected",
             "the ring backward's arithmetic: the blocks go round the ring to be collected, "
             "autograd differentiates attention over all of them at once, and the gradients "
             "then go round the ring only to look like it",
             checked_by=("test-ring-backward",),
             source="""    n, d = q.shape[2], q.shape[3]
    blocks = {}
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="kv", async_op=True)
        blocks[source] = block
        if travelling is not None:
            block = travelling.wait()
    with torch.enable_grad():
        queries = q.float().detach().requires_grad_()
        every = torch.stack([blocks[s] for s in range(size)]).float().requires_grad_()
        keys, values = torch.cat(list(every[:, 0]), dim=2), torch.cat(list(every[:, 1]), dim=2)
        scores = queries @ keys.transpose(-2, -1) / d ** 0.5
        if causal:
            mine, theirs = torch.arange(rank * n, (rank + 1) * n), torch.arange(size * n)
            scores = scores.masked_fill(mine[:, None] < theirs[None, :], float("-inf"))
        (torch.softmax(scores, -1) @ values).backward(grad_out.float())
    coming = None
    for step in range(size):
        grads = every.grad[(rank - step) % size].clone()
        if coming is not None:
            grads += coming.wait()
        coming = collectives.shift(grads.to(block.dtype), group=group, when="grads", async_op=True)
    home = coming.wait()
    return queries.grad.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)"""),
    ],
    "impl-zigzag": [
        Fake("keeps the plain split",
             "the zigzag pairing: cuts the sequence into cp contiguous parts, so causal work "
             "grows with the rank",
             checked_by=("test-zigzag",),
             source="""    return list(x.chunk(cp_size, dim=dim))"""),
        Fake("pairs chunk r with chunk r + cp",
             "the mirror: each rank gets two chunks, but an early rank gets two early ones and "
             "the causal work stays unequal",
             checked_by=("test-zigzag",),
             source="""    chunks = x.chunk(2 * cp_size, dim=dim)
    return [torch.cat([chunks[r], chunks[r + cp_size]], dim=dim) for r in range(cp_size)]"""),
        Fake("calls the library",
             "writes no split: delegates to context_parallel.split_sequence",
             checked_by=("test-zigzag",),
             source=('    return context_parallel.split_sequence(x, cp_size, layout="zigzag", '
                     'dim=dim)')),
        Fake("a table made when the cell runs",
             "the pairing: the library's chunks_of, called for every cp up to 64 when the cell "
             "runs (before any check refuses it), gives a table the split only indexes",
             checked_by=("test-zigzag",),
             source="""    chunks = x.chunk(2 * cp_size, dim=dim)
    return [torch.cat([chunks[c] for c in _ZIGZAG[cp_size][r]], dim=dim)
            for r in range(cp_size)]


_ZIGZAG = {cp: [context_parallel.chunks_of(r, cp, layout="zigzag") for r in range(cp)]
           for cp in range(1, 65)}"""),
    ],
    "impl-seq-to-heads": [
        Fake("all-gathers the sequence",
             "the all-to-all: gathers every rank's tokens of every head, then keeps its own "
             "heads (right values, cp times the bytes, and no all-to-all)",
             checked_by=("test-ulysses",),
             source="""    full = collectives.all_gather_along(x, 2, group=group)
    rank = dist.get_rank(group)
    return full[:, rank * (h // size):(rank + 1) * (h // size)].contiguous()"""),
        Fake("calls torch's all-to-all directly",
             "the recorded layer: dist.all_to_all_single in C++, which no count sees",
             checked_by=("test-ulysses",),
             source="""    rows = x.transpose(0, 1).contiguous()
    got = torch.empty_like(rows)
    dist.all_to_all_single(got, rows, group=group)
    got = got.view(size, h // size, b, n, d).permute(2, 1, 0, 3, 4)
    return got.reshape(b, h // size, size * n, d)"""),
        Fake("calls the library",
             "writes no all-to-all: delegates to context_parallel.seq_to_heads",
             checked_by=("test-ulysses",),
             source="""    return context_parallel.seq_to_heads(x, group, when)"""),
        Fake("a private copy of the library",
             "writes no all-to-all: loads context_parallel.py again with runpy and calls its "
             "seq_to_heads (not the refused function object)",
             checked_by=("test-ulysses",),
             source="""    import runpy
    copy = runpy.run_path(context_parallel.__file__, run_name="cp_copy")
    return copy["seq_to_heads"](x, group, when)"""),
        Fake("every row to every rank, uncounted (red team rt8)", "the data travel whole "
             "inside counting.uncounted(); the counted all-to-all carries zeros",
             ("test-ulysses",), """\
    rank = dist.get_rank(group)
    rows = x.transpose(0, 1).contiguous()
    with counting.uncounted():
        got = collectives.all_to_all(rows.repeat(size, 1, 1, 1), [h] * size, [h] * size,
                                     group=group, impl="pairwise", when=when)
    collectives.all_to_all(torch.zeros_like(rows), [h // size] * size, [h // size] * size,
                           group=group, impl="pairwise", when=when)
    mine = got.view(size, h, b, n, d)[:, rank * h // size:(rank + 1) * h // size]
    return mine.permute(2, 1, 0, 3, 4).reshape(b, h // size, size * n, d)"""),
    ],
    "impl-heads-to-seq": [
        Fake("all-gathers the heads",
             "the all-to-all: gathers every rank's heads of the whole sequence, then keeps its "
             "own tokens",
             checked_by=("test-ulysses",),
             source="""    full = collectives.all_gather_along(x, 1, group=group)
    return full.chunk(size, dim=2)[dist.get_rank(group)].contiguous()"""),
        Fake("calls torch's all-to-all directly",
             "the recorded layer: dist.all_to_all_single in C++, which no count sees",
             checked_by=("test-ulysses",),
             source="""    rows = x.view(b, heads, size, n, d).permute(2, 1, 0, 3, 4).contiguous()
    rows = rows.view(size * heads, b, n, d)
    got = torch.empty_like(rows)
    dist.all_to_all_single(got, rows, group=group)
    return got.transpose(0, 1)"""),
        Fake("calls the library",
             "writes no all-to-all: delegates to context_parallel.heads_to_seq",
             checked_by=("test-ulysses",),
             source="""    return context_parallel.heads_to_seq(x, group, when)"""),
        Fake("a private copy of the library",
             "writes no all-to-all: loads context_parallel.py again with runpy and calls its "
             "heads_to_seq (not the refused function object)",
             checked_by=("test-ulysses",),
             source="""    import runpy
    copy = runpy.run_path(context_parallel.__file__, run_name="cp_copy")
    return copy["heads_to_seq"](x, group, when)"""),
    ],
    "impl-predict": [
        Fake("no overlap in the ring",
             "the ring's overlap: adds each step's transfer to its compute instead of taking "
             "the longer of the two",
             checked_by=("test-predict",),
             source="""    flops = 4 * BATCH * HEADS * (seq_len / cp_size) * seq_len * HEAD_DIM
    work = flops / flops_per_second
    step = work / cp_size
    block = BATCH * HEADS * seq_len / cp_size * HEAD_DIM * 4
    transfer = link.alpha + 2 * block * link.beta
    ring = step + (cp_size - 1) * (step + transfer)
    ulysses = work + 4 * (link.alpha + (cp_size - 1) / cp_size * block * link.beta)
    return ring, ulysses"""),
        Fake("Ulysses sends whole tensors",
             "the all-to-all's (cp-1)/cp: sends all of each tensor, the share a rank keeps "
             "included",
             checked_by=("test-predict",),
             source="""    flops = 4 * BATCH * HEADS * (seq_len / cp_size) * seq_len * HEAD_DIM
    work = flops / flops_per_second
    step = work / cp_size
    block = BATCH * HEADS * seq_len / cp_size * HEAD_DIM * 4
    ring = step + (cp_size - 1) * max(step, link.alpha + 2 * block * link.beta)
    ulysses = work + 4 * (link.alpha + block * link.beta)
    return ring, ulysses"""),
        Fake("calls the library",
             "writes no model: delegates to context_parallel.forward_times",
             checked_by=("test-predict",),
             source="""    shape = (seq_len, BATCH, HEADS, HEAD_DIM, cp_size)
    times = context_parallel.forward_times(*shape, link, flops_per_second)
    return times["ring"], times["ulysses"]"""),
    ],
}


# The red team's fakes (issue 38), written from the student notebook and deck alone: torch's
# collectives carry the data while right-sized minidist messages go for show, the library's code
# cloned under another name when the cell runs, torch's own zigzag, a group ignored.
FAKES["impl-merge"] += [
    Fake("the library's code under another name",
         "writes no merge: a function made when the cell runs from merge_partials' code object "
         "renamed (before any check refuses merge_partials)",
         checked_by=("test-merge",),
         source="""    return _merged(out1, lse1, out2, lse2)


import types
_merged = types.FunctionType(context_parallel.merge_partials.__code__.replace(co_name="_merged"),
                             vars(context_parallel), "_merged")"""),
]
FAKES["impl-ring-forward"] += [
    Fake("torch's all-gather carries the blocks",
         "the ring: every key/value block comes by torch's dist.all_gather; the ring's async "
         "shifts go only for the byte count and the overlap picture, what arrives is dropped",
         checked_by=("test-ring-forward",),
         source="""    everyone = [torch.empty_like(block) for _ in range(size)]
    dist.all_gather(everyone, block.contiguous(), group=group)
    show = block
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(show, group=group, when="forward", async_op=True)
        kv = everyone[source]
        if not causal or source <= rank:
            part = context_parallel.block_attention(q, kv[0], kv[1],
                                                    diagonal=causal and source == rank)
            out, lse = context_parallel.merge_partials(out, lse, *part)
        if travelling is not None:
            show = travelling.wait()"""),
    Fake("ignores the group",
         "the group: the solution, but its blocks go round the default group's ring, so on a "
         "sub-group (a mesh's cp group) a rank receives another group's block",
         checked_by=("test-ring-forward",),
         source="""    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, when="forward", async_op=True)
        if not causal or source <= rank:
            part = context_parallel.block_attention(q, block[0], block[1],
                                                    diagonal=causal and source == rank)
            out, lse = context_parallel.merge_partials(out, lse, *part)
        if travelling is not None:
            block = travelling.wait()"""),
]
FAKES["impl-ring-backward"] += [
    Fake("torch's all-gather and all-reduce carry the data",
         "the ring: the key/value blocks come by torch's dist.all_gather and each block's "
         "gradient shares are summed at their owner by torch's dist.all_reduce; the ring's "
         "shifts (blocks and zero gradients) go only for the byte and message counts",
         checked_by=("test-ring-backward",),
         source="""    scale = 1 / q.shape[-1] ** 0.5
    everyone = [torch.empty_like(block) for _ in range(size)]
    dist.all_gather(everyone, block.contiguous(), group=group)
    qf, dof = q.float(), grad_out.float()
    delta = (dof * out.float()).sum(-1)
    grad_q = torch.zeros_like(qf)
    mine = None
    for source in range(size):
        share = torch.zeros(block.shape, dtype=torch.float32)
        if not causal or source <= rank:
            kf, vf = everyone[source][0].float(), everyone[source][1].float()
            s = qf @ kf.transpose(-2, -1) * scale
            if causal and source == rank:
                n = q.shape[2]
                s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            p = (s - lse.float().unsqueeze(-1)).exp()
            share[1] = p.transpose(-2, -1) @ dof
            ds = p * (dof @ vf.transpose(-2, -1) - delta.unsqueeze(-1))
            grad_q += ds @ kf * scale
            share[0] = ds.transpose(-2, -1) @ qf * scale
        if size > 1:
            dist.all_reduce(share, group=group)
        if source == rank:
            mine = share
    show = block
    for step in range(size - 1):
        show = collectives.shift(show, group=group, when="backward")
    junk = torch.zeros_like(block)
    for _ in range(size if size > 1 else 0):
        collectives.shift(junk, group=group, when="backward")
    return grad_q.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)"""),
    Fake("ignores the group",
         "the group: the solution, but the blocks and gradients go round the default group's "
         "ring, so on a sub-group (a mesh's cp group) they come from and go to another group",
         checked_by=("test-ring-backward",),
         source="""    scale = q.shape[-1] ** -0.5
    queries, grad_out32 = q.float(), grad_out.float()
    delta = (grad_out32 * out.float()).sum(-1, keepdim=True)
    grad_q = torch.zeros_like(queries)
    arriving = None
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, when="kv", async_op=True)
        grads = torch.zeros(block.shape)
        if not causal or source <= rank:
            keys, values = block[0].float(), block[1].float()
            scores = queries @ keys.transpose(-2, -1) * scale
            if causal and source == rank:
                hidden = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            probs = (scores - lse.float().unsqueeze(-1)).exp()
            grads[1] = probs.transpose(-2, -1) @ grad_out32
            grad_scores = probs * (grad_out32 @ values.transpose(-2, -1) - delta)
            grad_q += grad_scores @ keys * scale
            grads[0] = grad_scores.transpose(-2, -1) @ queries * scale
        if arriving is not None:
            grads += arriving.wait()
        arriving = collectives.shift(grads, when="grads", async_op=True)
        if travelling is not None:
            block = travelling.wait()
    home = arriving.wait()
    return grad_q.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)"""),
]
FAKES["impl-zigzag"] += [
    Fake("torch's private head-tail load balancer",
         "writes no split: torch's context parallelism's _HeadTailLoadBalancer gives the "
         "zigzag order, which the split only indexes",
         checked_by=("test-zigzag",),
         # imported when the cell runs: a first import inside a checked call runs every
         # function of torch.distributed.tensor under the refusal's profile hook (seconds)
         source="""\
    order = _load_balancer._HeadTailLoadBalancer(x.shape[dim], cp_size, "cpu")
    order = order._generate_indices()[0]
    return list(x.index_select(dim, order.to(x.device)).chunk(cp_size, dim))


from torch.distributed.tensor.experimental._context_parallel import _load_balancer"""),
]
FAKES["impl-seq-to-heads"] += [
    Fake("torch's all-gather carries the data",
         "the all-to-all: the tokens come by torch's dist.all_gather; a pairwise "
         "collectives.all_to_all of the right sizes goes only for show, its result dropped",
         checked_by=("test-ulysses",),
         source="""    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    me = dist.get_rank(group)
    collectives.all_to_all(x.transpose(0, 1).contiguous(), [h // size] * size, [h // size] * size,
                           group=group, impl="pairwise", when=when)
    return torch.cat(parts, dim=2)[:, me * (h // size):(me + 1) * (h // size)].contiguous()"""),
]
FAKES["impl-heads-to-seq"] += [
    Fake("torch's all-gather carries the data",
         "the all-to-all: the heads come by torch's dist.all_gather; a pairwise "
         "collectives.all_to_all of the right sizes goes only for show, its result dropped",
         checked_by=("test-ulysses",),
         source="""    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    me = dist.get_rank(group)
    rows = x.contiguous().view(b, heads, size, n, d).permute(2, 1, 0, 3, 4).contiguous()
    collectives.all_to_all(rows.view(size * heads, b, n, d), [heads] * size, [heads] * size,
                           group=group, impl="pairwise", when=when)
    return torch.cat(parts, dim=1)[:, :, me * n:(me + 1) * n].contiguous()"""),
]
FAKES["impl-predict"] += [
    Fake("the library's code under another name",
         "writes no model: a function made when the cell runs from forward_times' code object "
         "renamed, with its defaults (before any check refuses forward_times)",
         checked_by=("test-predict",),
         source="""    shape = (seq_len, BATCH, HEADS, HEAD_DIM, cp_size)
    got = _times(*shape, link, flops_per_second)
    return got["ring"], got["ulysses"]


import types
_times = types.FunctionType(context_parallel.forward_times.__code__.replace(co_name="_times"),
                            vars(context_parallel), "_times",
                            context_parallel.forward_times.__defaults__)"""),
]

ALTERNATIVES = {
    "impl-ring-backward": [
        Alternative("the gradients travel in the inputs' dtype",
                    "sums in fp32 on each rank, as the spec asks, but the travelling gradient "
                    "goes in the inputs' dtype, as the library sends it (half the bytes in bf16); "
                    "the spec allows either", ("test-ring-backward",), """\
    scale = q.shape[-1] ** -0.5
    queries, grad_out32 = q.float(), grad_out.float()
    delta = (grad_out32 * out.float()).sum(-1, keepdim=True)
    grad_q = torch.zeros_like(queries)
    arriving = None
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="kv", async_op=True)
        grads = torch.zeros(block.shape)
        if not causal or source <= rank:
            keys, values = block[0].float(), block[1].float()
            scores = queries @ keys.transpose(-2, -1) * scale
            if causal and source == rank:
                hidden = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            probs = (scores - lse.float().unsqueeze(-1)).exp()
            grads[1] = probs.transpose(-2, -1) @ grad_out32
            grad_scores = probs * (grad_out32 @ values.transpose(-2, -1) - delta)
            grad_q += grad_scores @ keys * scale
            grads[0] = grad_scores.transpose(-2, -1) @ queries * scale
        if arriving is not None:
            grads += arriving.wait().float()
        arriving = collectives.shift(grads.to(block.dtype), group=group, when="grads",
                                     async_op=True)
        if travelling is not None:
            block = travelling.wait()
    home = arriving.wait()
    return grad_q.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)
"""),
    ],
    "impl-predict": [
        Alternative("the ring step by step", "walks the ring's cp steps one by one and sums them, "
                    "with s/cp as real division and the terms in another order: the same model, "
                    "other rounding, and 4096 tokens over cp = 3 not rounded to whole tokens",
                    ("test-predict",), """\
    local = seq_len / cp_size  # tokens per rank: the model's, not a layout's
    block_bytes = 4 * BATCH * HEADS * local * HEAD_DIM
    flops = 4 * BATCH * HEADS * local * seq_len * HEAD_DIM
    step = flops / cp_size / flops_per_second
    transfer = link.alpha + 2 * block_bytes * link.beta
    ring = 0.0
    for k in range(cp_size):
        ring += step if k == cp_size - 1 else max(step, transfer)
    all_to_all = link.alpha + block_bytes * link.beta * (cp_size - 1) / cp_size
    ulysses = flops / flops_per_second + 4 * all_to_all
    return ring, ulysses
"""),
    ],
}

# Red team rt6: the library's code cloned when the cell runs, every mark of its origin stripped
# (name, place, docstring, locals' names, line table).
FAKES["impl-merge"] += [
    Fake("the library's merge cloned without its marks",
         "writes no merge: context_parallel.merge_partials cloned when the cell runs, stripped "
         "of every mark of its origin", checked_by=("test-merge",), source="""\
    return _merge(out1, lse1, out2, lse2)

""" + stripped_clone_helpers() + """
_merge = _stripped(context_parallel.merge_partials)"""),
]
FAKES["impl-zigzag"] += [
    Fake("the library's layout cloned without its marks",
         "writes no layout: context_parallel.chunks_of (and the _check_layout it calls) cloned "
         "when the cell runs, stripped of every mark of their origin",
         checked_by=("test-zigzag",), source="""\
    pieces = x.chunk(2 * cp_size, dim=dim)
    return [torch.cat([pieces[c] for c in _chunks_of(r, cp_size, layout="zigzag")], dim=dim)
            for r in range(cp_size)]

""" + stripped_clone_helpers() + """
_chunks_of = _stripped(context_parallel.chunks_of,
                       _check_layout=_stripped(context_parallel._check_layout))"""),
]
FAKES["impl-predict"] += [
    Fake("the library's model cloned without its marks",
         "derives no model: context_parallel.forward_times cloned when the cell runs, stripped "
         "of every mark of its origin", checked_by=("test-predict",), source="""\
    got = _forward_times(seq_len, BATCH, HEADS, HEAD_DIM, cp_size, link, flops_per_second)
    return got["ring"], got["ulysses"]

""" + stripped_clone_helpers() + """
_forward_times = _stripped(context_parallel.forward_times)"""),
]

# Red team rt13 (issue 38), written from the student notebook and deck alone.
FAKES["impl-merge"] += [
    Fake("PyTorch's merger, the empty parts handled first",
         "writes no merge: torch's context-parallel _SDPAMerger rescales and adds the two "
         "parts; a part with lse = -inf is passed through by torch.where",
         checked_by=("test-merge",),
         source="""\
    from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger
    merger = _SDPAMerger(convert_to_f32=True, seq_dim=2)
    merger.step(out1, lse1, False)
    merger.step(out2, lse2, False)
    out, lse = merger.results()
    empty1, empty2 = torch.isneginf(lse1), torch.isneginf(lse2)
    out = torch.where(empty1.unsqueeze(-1), out2.to(out.dtype),
                      torch.where(empty2.unsqueeze(-1), out1.to(out.dtype), out))
    lse = torch.where(empty1, lse2.to(lse.dtype), torch.where(empty2, lse1.to(lse.dtype), lse))
    return out, lse"""),
]
FAKES["impl-zigzag"] += [
    Fake("the library's split, its source tweaked",
         "writes no split: context_parallel.chunks_of and split_sequence exec'd from their "
         "source with one harmless statement added",
         checked_by=("test-zigzag",),
         source="""\
    global _SPLIT_COPY
    if "_SPLIT_COPY" not in globals():
        import inspect as _inspect, textwrap as _textwrap
        _SPLIT_COPY = dict(vars(context_parallel))
        for _f in (context_parallel.chunks_of, context_parallel.split_sequence):
            _lines = _textwrap.dedent(_inspect.getsource(_f)).split("\\n")
            _k = next(i for i, l in enumerate(_lines) if l.strip().startswith("_check_layout"))
            _lines.insert(_k, "    _unused = 0")
            exec(compile("\\n".join(_lines), "<mine>", "exec"), _SPLIT_COPY)
    return _SPLIT_COPY["split_sequence"](x, cp_size, layout="zigzag", dim=dim)"""),
]
FAKES["impl-predict"] += [
    Fake("the library's forward times, its source tweaked",
         "derives nothing: context_parallel.forward_times exec'd from its own source with one "
         "harmless statement added",
         checked_by=("test-predict",),
         source="""\
    global _FORWARD_TIMES_COPY
    if "_FORWARD_TIMES_COPY" not in globals():
        import inspect as _inspect, textwrap as _textwrap
        _lines = _textwrap.dedent(_inspect.getsource(context_parallel.forward_times)).split("\\n")
        _body = next(i for i, l in enumerate(_lines) if l.strip().startswith("step ="))
        _lines.insert(_body, "    _unused = 0")
        _namespace = dict(vars(context_parallel))
        exec(compile("\\n".join(_lines), "<mine>", "exec"), _namespace)
        _FORWARD_TIMES_COPY = _namespace["forward_times"]
    times = _FORWARD_TIMES_COPY(seq_len, BATCH, HEADS, HEAD_DIM, cp_size, link, flops_per_second)
    return times["ring"], times["ulysses"]"""),
]

# Red team rt13 (stop 47): the library's split compiled again from its source, its checks removed.
FAKES["impl-zigzag"] += [
    Fake("the library's split recompiled without its checks",
         "writes no layout: split_sequence and chunks_of compiled from their source with their "
         "_check_ lines removed and a line added",
         checked_by=("test-zigzag",), source="""\
    global _SPLIT_COPY
    if "_SPLIT_COPY" not in globals():
        import inspect as _inspect, textwrap as _textwrap
        _SPLIT_COPY = dict(vars(context_parallel))
        for _f in (context_parallel.chunks_of, context_parallel.split_sequence):
            _lines = [l for l in _textwrap.dedent(_inspect.getsource(_f)).split("\n")
                      if "_check_" not in l]
            _a = next(i for i, l in enumerate(_lines) if ''''' in l)  # the docstring's first line
            _k = _a + 1 if _lines[_a].count(''''') == 2 else next(
                i for i in range(_a + 1, len(_lines)) if ''''' in _lines[i]) + 1
            _lines.insert(_k, "    _unused = 0")
            exec(compile("\n".join(_lines), "<mine>", "exec"), _SPLIT_COPY)
    return _SPLIT_COPY["split_sequence"](x, cp_size, layout="zigzag", dim=dim)"""),
]

# Red team rt19 (issue 38): the library's zigzag pairing read for every cp up to 256 when an
# earlier cell ran (before any check refuses it); the split only chunks and indexes the table.
# (The red team's table went in cell answer-plain_imbalance; at module level after the function,
# as here, it is made at the same point, before the check.)
FAKES["impl-zigzag"] += [
    Fake("a table of the library's pairings up to cp = 256",
         "red team rt19: context_parallel.chunks_of(r, c, layout='zigzag') for every c <= 256 "
         "read before the check; the split indexes it", checked_by=("test-zigzag",), source="""\
    chunks = x.chunk(2 * cp_size, dim=dim)
    return [torch.cat([chunks[c] for c in _ZIGZAG[cp_size][r]], dim=dim) for r in range(cp_size)]


# which chunks each rank holds, for every cp I may meet (read from the library once)
_ZIGZAG = {c: [context_parallel.chunks_of(r, c, layout="zigzag") for r in range(c)]
           for c in range(1, 257)}"""),
]

# Red team, stop 52: the log-sum-exps exponentiated in float64, which holds e^709: right for the
# scores of hundreds the notebook shows, inf/inf beyond.
FAKES["impl-merge"] += [
    Fake("log-sum-exps exponentiated in float64", "red team, stop 52: the exercise's one rule "
         "(never exponentiate a log-sum-exp) broken; float64 hides it up to e^709",
         ("test-merge",), """\
    w1, w2 = lse1.double().exp(), lse2.double().exp()
    total = w1 + w2
    share1, share2 = torch.nan_to_num(w1 / total), torch.nan_to_num(w2 / total)
    out = out1 * share1.unsqueeze(-1).to(out1.dtype) + out2 * share2.unsqueeze(-1).to(out2.dtype)
    return out, total.log().to(lse1.dtype)"""),
]
FAKES["impl-ring-forward"] += [
    Fake("the overlap noted by hand, nothing in flight", "red team, stop 52: each block's "
         "attention runs after the transfer's wait; an 'attention' Event with the right pair "
         "count is noted by the function itself while the block travels",
         ("test-ring-forward",), """\
    b, h, n, d = q.shape
    for step in range(size):
        source = (rank - step) % size
        visible = not causal or source <= rank
        diagonal = causal and source == rank
        pending = (collectives.shift(block, group=group, when="forward", async_op=True)
                   if step < size - 1 else None)
        start = timeline.clock()
        if visible:
            pairs = b * h * (n * (n + 1) // 2 if diagonal else n * k.shape[2])
            timeline.note(timeline.Event(rank, "attention", "forward", start, timeline.clock(),
                                         pairs))
        current = block
        if pending is not None:
            block = pending.wait()
        if visible:
            part = context_parallel.block_attention(q, current[0], current[1], diagonal=diagonal)
            out, lse = context_parallel.merge_partials(out, lse, *part)"""),
]

# Red team, stop 52: ring backwards the checks took for overlapped and skipping (they counted
# bytes, messages and values only): checked now by what ran while the shifts were in flight.
_BACKWARD_BLOCK = """\
            kb, vb = current[0].float(), current[1].float()
            x = qf @ kb.transpose(-2, -1) * scale
            if causal and source == rank:
                x = x.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            p = (x - lse.float().unsqueeze(-1)).exp()
            dx = p * (gof @ vb.transpose(-2, -1) - delta)
            grad_q += dx @ kb * scale
            grads[0] = dx.transpose(-2, -1) @ qf * scale
            grads[1] = p.transpose(-2, -1) @ gof"""
_BACKWARD_START = """\
    b, h, n, d = q.shape
    scale = d ** -0.5
    qf, gof = q.float(), grad_out.float()
    delta = (gof * out.float()).sum(-1, keepdim=True)
    grad_q = torch.zeros(q.shape)
    coming = None
    for step in range(size):
        source = (rank - step) % size"""
_BACKWARD_END = """\
        if coming is not None:
            grads += coming.float()
        coming = collectives.shift(grads.to(k.dtype), group=group, when="backward, grads")
    return grad_q.to(q.dtype), coming[0].to(k.dtype), coming[1].to(v.dtype)"""
FAKES["impl-ring-backward"] += [
    Fake("every shift blocking, nothing in flight", "red team, stop 52: the key/value blocks "
         "and the gradients each move by a blocking shift; no compute overlaps a transfer",
         ("test-ring-backward",), f"""\
{_BACKWARD_START}
        current = block
        if step < size - 1:
            block = collectives.shift(block, group=group, when="backward")
        grads = torch.zeros(current.shape)
        if not causal or source <= rank:
{_BACKWARD_BLOCK}
{_BACKWARD_END}"""),
    Fake("a sliver in flight, the block's work after the wait", "red team, stop 52: a 1x1 "
         "matmul runs while the block travels; every block's gradient work after its wait",
         ("test-ring-backward",), f"""\
{_BACKWARD_START}
        pending = (collectives.shift(block, group=group, when="backward", async_op=True)
                   if step < size - 1 else None)
        _ = qf[:, :, :1] @ qf[:, :, :1].transpose(-2, -1)
        current = block
        if pending is not None:
            block = pending.wait()
        grads = torch.zeros(current.shape)
        if not causal or source <= rank:
{_BACKWARD_BLOCK}
{_BACKWARD_END}"""),
    Fake("hidden blocks computed under the mask", "red team, stop 52: every block's gradient is "
         "computed, the causal mask zeroing what a rank must not see, instead of skipping it",
         ("test-ring-backward",), f"""\
{_BACKWARD_START}
        pending = (collectives.shift(block, group=group, when="backward", async_op=True)
                   if step < size - 1 else None)
        current = block
        grads = torch.zeros(current.shape)
        kb, vb = current[0].float(), current[1].float()
        x = qf @ kb.transpose(-2, -1) * scale
        if causal:
            positions = torch.arange(n)
            x = x.masked_fill((positions + source * n)[None, :] > (positions + rank * n)[:, None],
                              float("-inf"))
        p = (x - lse.float().unsqueeze(-1)).exp()
        dx = p * (gof @ vb.transpose(-2, -1) - delta)
        grad_q += dx @ kb * scale
        grads[0] = dx.transpose(-2, -1) @ qf * scale
        grads[1] = p.transpose(-2, -1) @ gof
        if pending is not None:
            block = pending.wait()
{_BACKWARD_END}"""),
]

# --- Red team rt7 (issue 38): rings whose messages, counts and overlap look right but that keep
# every key/value block (or every block's gradient share) to the end: a second pass over all of
# them instead of the online merge, a one-query decoy attended while each block travels, the
# gradients sent on a lap of their own. The hidden checks now measure the most a rank holds at
# once on a ring of 8.
# The ring with every block kept (held, with whether its diagonal is masked); `{attend}` is
# what each kept block gets as it comes, and `{scores}` the second pass's scores of a held one.
_EVERY_BLOCK_KEPT = """\
    n, scale = q.shape[2], q.shape[-1] ** -0.5
    held, lses = [], []
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="forward", async_op=True)
        if not causal or source <= rank:
            diagonal = causal and source == rank
{attend}
            held.append((block, diagonal))
        if travelling is not None:
            block = travelling.wait()
"""
_HELD_SCORES = """\
        scores = (q.float() @ kv[0].float().transpose(-2, -1)) * scale
        if diagonal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
"""
FAKES["impl-ring-forward"] += [
    Fake("every block kept, a second pass", "each block's lse taken as it comes, its output "
         "dropped; the output recomputed over every kept block once the ring ends, no merge "
         "(red team rt7)", checked_by=("test-ring-forward",), source=_EVERY_BLOCK_KEPT.format(
             attend="""\
            _, part_lse = context_parallel.block_attention(q, block[0], block[1],
                                                           diagonal=diagonal)
            lses.append(part_lse)""") + """\
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    for kv, diagonal in held:
""" + _HELD_SCORES + """\
        out = out + torch.exp(scores - lse.unsqueeze(-1)) @ kv[1].float()"""),
    Fake("a decoy attended while each block travels", "a one-query attention for show during "
         "each transfer; the real attention over every kept block after the ring (red team rt7)",
         checked_by=("test-ring-forward",), source=_EVERY_BLOCK_KEPT.format(attend="""\
            context_parallel.block_attention(q[:, :, :1], block[0], block[1])""") + """\
    parts = []
    for kv, diagonal in held:
""" + _HELD_SCORES + """\
        parts.append(scores)
    lse = torch.logsumexp(torch.stack([s.logsumexp(-1) for s in parts]), dim=0)
    for (kv, _), scores in zip(held, parts):
        out = out + torch.exp(scores - lse.unsqueeze(-1)) @ kv[1].float()"""),
]
FAKES["impl-ring-backward"].append(Fake(
    "every share kept, the gradients on a lap of their own", "each block's dk/dv share kept "
    "until the key/value lap ends, then the sums sent round a second lap (red team rt7)",
    checked_by=("test-ring-backward",), source="""\
    n, scale = q.shape[2], q.shape[-1] ** -0.5
    qf, gf, lf = q.float(), grad_out.float(), lse.float()
    delta = (gf * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros_like(qf)
    shares = {}
    for step in range(size):
        source = (rank - step) % size
        travelling = None
        if step < size - 1:
            travelling = collectives.shift(block, group=group, when="backward", async_op=True)
        if not causal or source <= rank:
            kb, vb = block[0].float(), block[1].float()
            scores = qf @ kb.transpose(-2, -1) * scale
            if causal and source == rank:
                hidden = ~torch.ones(n, n, dtype=torch.bool).tril()
                scores = scores.masked_fill(hidden, float("-inf"))
            p = torch.exp(scores - lf.unsqueeze(-1))
            dx = p * (gf @ vb.transpose(-2, -1) - delta)
            dq += dx @ kb * scale
            shares[source] = torch.stack([dx.transpose(-2, -1) @ qf * scale,
                                          p.transpose(-2, -1) @ gf])
        if travelling is not None:
            block = travelling.wait()
    coming = None
    for step in range(size):
        source = (rank - step) % size
        grads = shares.get(source, torch.zeros(block.shape))
        if coming is not None:
            grads = grads + coming.wait().float()
        coming = collectives.shift(grads.to(block.dtype), group=group, when="backward",
                                   async_op=True)
    home = coming.wait()
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)"""))
