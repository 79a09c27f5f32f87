"""Fakes of Lab 13's exercises: each gets the numbers right (or close) without the mechanism the
exercise is about, or hands the work to the library's own version."""

from fakes import Alternative, Fake

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
    ],
    "impl-ring-forward": [
        Fake("all-gathers every key and value",
             "the ring: gathers the whole sequence's keys and values on every rank, then "
             "attends block by block (right numbers, every rank holds all of K and V, nothing "
             "goes point to point to the right neighbour)",
             checked_by=("test-ring-forward",),
             source="""    keys = collectives.all_gather_along(k, 2, group)
    values = collectives.all_gather_along(v, 2, group)
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
            block = collectives.shift(block, group, "forward")"""),
        Fake("calls the library",
             "writes no ring: delegates to context_parallel.ring_forward",
             checked_by=("test-ring-forward",),
             source="""    out, lse = context_parallel.ring_forward(q, k, v, causal, group)"""),
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
    ],
    "impl-seq-to-heads": [
        Fake("all-gathers the sequence",
             "the all-to-all: gathers every rank's tokens of every head, then keeps its own "
             "heads (right values, cp times the bytes, and no all-to-all)",
             checked_by=("test-ulysses",),
             source="""    full = collectives.all_gather_along(x, 2, group)
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
    ],
    "impl-heads-to-seq": [
        Fake("all-gathers the heads",
             "the all-to-all: gathers every rank's heads of the whole sequence, then keeps its "
             "own tokens",
             checked_by=("test-ulysses",),
             source="""    full = collectives.all_gather_along(x, 1, group)
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

ALTERNATIVES = {
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
