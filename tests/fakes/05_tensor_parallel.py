"""Fakes of Lab 05's exercises: the right numbers without the sharding or the collectives they
teach. impl-f-g has four solution regions (the forward and backward of f and g) that each get
the same fake source, so its fakes pick their branch by the method they run in; impl-sp-operators
has six (the two collectives, then the four methods), each fake giving one source per region.
The first fake of each exercise breaks no other exercise's cells except those it lists."""

from fakes import Alternative, Fake

# impl-sp-operators' four methods as the solution writes them (its fakes change the collectives)
SP_METHODS = tuple(" " * 8 + f"return {call}" for call in (
    "all_gather_sequence(x)", "reduce_scatter_sequence(grad)",
    "reduce_scatter_sequence(x)", "all_gather_sequence(grad)"))

FAKES = {
    "impl-f-g": [
        Fake("sums by all-gather", "all-gathers every rank's tensor and sums locally instead of "
             "one all-reduce", ("test-f-g", "test-mlp", "test-attention"), """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        pieces = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, value.contiguous())
        return torch.stack(pieces).sum(dim=0)"""),
        Fake("the library's f and g", "delegates the all-reduces to tensor_parallel's own "
             "operators", ("test-f-g", "test-mlp", "test-attention"), """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        return tensor_parallel.ReduceFromParallel.apply(value.clone(), None)"""),
        Fake("all-reduces in place", "sums the incoming tensor itself instead of a copy: g "
             "overwrites its input, which autograd forbids", ("test-f-g",), """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        dist.all_reduce(value)
        return value"""),
    ],
    "impl-mlp": [
        Fake("the whole MLP on every rank", "computes unsharded on every rank, then passes 1/t of "
             "it through g so the collectives look right", ("test-mlp",), """\
    x = CopyToParallel.apply(x)
    whole = F.linear(F.gelu(fc1(x)), fc2.weight)
    return ReduceFromParallel.apply(whole / t) + fc2.bias"""),
        Fake("the bias split t ways", "adds fc2's bias before the sum, divided by t, instead of "
             "once after it", ("test-mlp",), """\
    x = CopyToParallel.apply(x)
    hidden = F.linear(x, shard_weight(fc1.weight, rank, t, "column"), fc1.bias.chunk(t)[rank])
    partial = F.linear(F.gelu(hidden), shard_weight(fc2.weight, rank, t, "row"), fc2.bias / t)
    return ReduceFromParallel.apply(partial)"""),
        Fake("no f", "leaves out f before the column layer: forward is right, but backward never "
             "sums x's partial gradients", ("test-mlp",), """\
    hidden = F.linear(x, shard_weight(fc1.weight, rank, t, "column"), fc1.bias.chunk(t)[rank])
    partial = F.linear(F.gelu(hidden), shard_weight(fc2.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + fc2.bias"""),
    ],
    "impl-attention": [
        Fake("an f per projection", "applies f to q, k and v apart: three all-reduces of x's "
             "gradient backward where one suffices", ("test-attention",), """\
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    q, k, v = (F.linear(CopyToParallel.apply(x), shard_weight(proj.weight, rank, t, "column"),
                        proj.bias.chunk(t)[rank]) for proj in projections)
    heads = attend(q, k, v, attn.heads // t)
    partial = F.linear(heads, shard_weight(attn.out_proj.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + attn.out_proj.bias"""),
        Fake("every head on every rank", "computes all heads on every rank, then passes 1/t of "
             "the output through g so the collectives look right", ("test-attention",), """\
    x = CopyToParallel.apply(x)
    whole = attend(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.heads)
    partial = F.linear(whole, attn.out_proj.weight) / t
    return ReduceFromParallel.apply(partial) + attn.out_proj.bias"""),
        Fake("all the heads in the core", "shards q, k and v by heads, then runs the core "
             "with every head's count: heads of 1/t the width", ("test-attention",), """\
    x = CopyToParallel.apply(x)
    q, k, v = (F.linear(x, shard_weight(proj.weight, rank, t, "column"), proj.bias.chunk(t)[rank])
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    heads = attend(q, k, v, attn.heads)
    partial = F.linear(heads, shard_weight(attn.out_proj.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + attn.out_proj.bias"""),
    ],
    "impl-vocab-ce": [
        Fake("gathers the logits", "all-gathers the [n, V] logits and calls F.cross_entropy",
             ("test-vocab-ce",), """\
    pieces = [torch.empty_like(local_logits) for _ in range(t)]
    dist.all_gather(pieces, local_logits.contiguous())
    return F.cross_entropy(torch.cat(pieces, dim=-1), targets, reduction="none")"""),
        Fake("all-reduces padded logits", "an all-gather in disguise: SUM all-reduce of the "
             "[n, V] logits, zero outside this rank's slice", ("test-vocab-ce",), """\
    whole = local_logits.new_zeros(local_logits.shape[0], vocab_local * t)
    whole[:, start:start + vocab_local] = local_logits
    dist.all_reduce(whole)
    return F.cross_entropy(whole, targets, reduction="none")"""),
        Fake("each rank's own max", "shifts by this rank's maximum only, with no MAX "
             "all-reduce: the ranks' sums of exponentials are scaled differently",
             ("test-vocab-ce",), """\
    shifted = local_logits - local_logits.max(dim=-1, keepdim=True).values
    mine = (targets >= start) & (targets < start + vocab_local)
    local_targets = (targets - start).masked_fill(~mine, 0)
    target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1) * mine
    sums = torch.stack([target_logit, shifted.exp().sum(dim=-1)])
    dist.all_reduce(sums)
    return sums[1].log() - sums[0]"""),
    ],
    "impl-tp-seconds": [
        Fake("2S whatever t", "sends two full tensors per all-reduce, the ring's 2(t-1)/t read as "
             "2: right only in the large-t limit", ("test-tp-seconds",), """\
    flops = 24 * b * s * h * h / t
    sent = 2 * 2 * b * s * h * bytes_per_element
    return {"compute": flops / peak_flops, "communication": sent / bandwidth}"""),
        Fake("unsharded compute", "counts the whole layer's matmuls on every rank, not 1/t",
             ("test-tp-seconds",), """\
    flops = 24 * b * s * h * h
    sent = 2 * 2 * (t - 1) / t * b * s * h * bytes_per_element
    return {"compute": flops / peak_flops, "communication": sent / bandwidth}"""),
        Fake("one all-reduce per layer", "the popular misstatement: one forward all-reduce per "
             "layer instead of two", ("test-tp-seconds",), """\
    flops = 24 * b * s * h * h / t
    sent = 2 * (t - 1) / t * b * s * h * bytes_per_element
    return {"compute": flops / peak_flops, "communication": sent / bandwidth}"""),
    ],
    "impl-sp-operators": [
        Fake("all-reduces instead", "gathers by all-reducing a zero-padded sequence and "
             "reduce-scatters by all-reducing then slicing: right values, twice the bytes or more",
             ("test-sp-operators",), ("""\
    t, rank, n = dist.get_world_size(), dist.get_rank(), x.shape[1]
    full = x.new_zeros(x.shape[0], n * t, *x.shape[2:])
    full[:, rank * n:(rank + 1) * n] = x
    dist.all_reduce(full)
    return full""", """\
    total = x.clone()
    dist.all_reduce(total)
    return total.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()""")
             + SP_METHODS),
        Fake("the library's operators", "delegates to tensor_parallel's own sequence gather and "
             "reduce-scatter", ("test-sp-operators",), ("""\
    return tensor_parallel.GatherAlong.apply(x, 1, None)""", """\
    return tensor_parallel.ReduceScatterToSequenceParallel.apply(x, None)""") + SP_METHODS),
        Fake("joined along dim 0", "all_gather_into_tensor joins the slices along the batch, "
             "then a view calls it a sequence", ("test-sp-operators",), ("""\
    out = x.new_empty(x.shape[0] * dist.get_world_size(), *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous())
    return out.view(x.shape[0], -1, *x.shape[2:])""", """\
    pieces = [piece.contiguous() for piece in x.chunk(dist.get_world_size(), dim=1)]
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces)
    return mine""") + SP_METHODS),
        Fake("g's backward payload masked (red team rt8)", "each rank's gradient plus a constant "
             "that cancels over the ranks goes into the reduce-scatter: right sums, not each "
             "rank's own gradient on the wire", ("test-sp-operators",), ("""\
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)""", """\
    pieces = [piece.contiguous() for piece in x.chunk(dist.get_world_size(), dim=1)]
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces)
    return mine""", SP_METHODS[0], " " * 8 + "t, r = dist.get_world_size(), dist.get_rank()\n"
             + " " * 8 + "return reduce_scatter_sequence(grad + 0.25 * (2 * r - (t - 1)))",
             *SP_METHODS[2:])),
    ],
}

ALTERNATIVES = {
    "impl-vocab-ce": [
        Alternative("Megatron-LM's three all-reduces", "sums the target logits and the sums of "
                    "exponentials in two all-reduces, as megatron/core/tensor_parallel/"
                    "cross_entropy.py does, where the solution stacks them into one (the fused "
                    "variant): the spec allows up to three", ("test-vocab-ce",), """\
    row_max = local_logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX)
    shifted = local_logits - row_max.unsqueeze(-1)
    mine = (targets >= start) & (targets < start + vocab_local)
    local_targets = (targets - start).masked_fill(~mine, 0)
    target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(target_logit)
    sum_exp = shifted.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    return sum_exp.log() - target_logit"""),
    ],
}

# --- The red team's fakes (issue 38): each escaped the checks as they were -------------------

FAKES["impl-mlp"] += [
    Fake("the whole MLP on every rank", "every rank computes the whole MLP with the unsharded "
         "weights, other ranks' parts detached; f and g run on zeros for show",
         ("test-mlp",), """\
    def mine_only(w, dim):
        parts = w.chunk(t, dim)
        return torch.cat([p if i == rank else p.detach() for i, p in enumerate(parts)], dim)

    out = F.linear(F.gelu(F.linear(x, mine_only(fc1.weight, 0), mine_only(fc1.bias, 0))),
                   mine_only(fc2.weight, 1)) + fc2.bias
    shown = ReduceFromParallel.apply(torch.zeros_like(out))  # g's all-reduce, of zeros
    return out + shown + 0 * CopyToParallel.apply(x)  # f's backward all-reduce, of zeros"""),
    Fake("g without f", "Megatron's forward, but x's gradient recomputed through a frozen whole "
         "copy of the MLP; f all-reduces zeros for show", ("test-mlp",), """\
    h = F.linear(x.detach(), shard_weight(fc1.weight, rank, t, "column"), fc1.bias.chunk(t)[rank])
    partial = F.linear(F.gelu(h), shard_weight(fc2.weight, rank, t, "row"))
    out = ReduceFromParallel.apply(partial) + fc2.bias
    whole = F.linear(F.gelu(F.linear(x, fc1.weight.detach(), fc1.bias.detach())),
                     fc2.weight.detach()) + fc2.bias.detach()
    return out + (whole - whole.detach()) + 0 * CopyToParallel.apply(x)"""),
]
FAKES["impl-attention"] += [
    Fake("every head on every rank", "every rank runs all heads with the unsharded "
         "projections, other ranks' parts detached; f and g run on zeros for show",
         ("test-attention",), """\
    def mine_only(w, dim):
        parts = w.chunk(t, dim)
        return torch.cat([p if i == rank else p.detach() for i, p in enumerate(parts)], dim)

    q, k, v = (F.linear(x, mine_only(p.weight, 0), mine_only(p.bias, 0))
               for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out = F.linear(attend(q, k, v, attn.heads), mine_only(attn.out_proj.weight, 1),
                   attn.out_proj.bias)
    return out + ReduceFromParallel.apply(torch.zeros_like(out)) + 0 * CopyToParallel.apply(x)"""),
]
FAKES["impl-vocab-ce"].append(Fake(
    "the logits gathered through distributed_c10d", "all-gathers the whole logits through "
    "torch.distributed.distributed_c10d and runs F.cross_entropy; the per-token all-reduces "
    "run on zeros for show", ("test-vocab-ce",), """\
    from torch.distributed import distributed_c10d as c10d

    pieces = [torch.empty_like(local_logits) for _ in range(t)]
    c10d.all_gather(pieces, local_logits.contiguous())
    loss = F.cross_entropy(torch.cat(pieces, dim=-1), targets, reduction="none")
    n = targets.shape[0]
    dist.all_reduce(torch.zeros(n), op=dist.ReduceOp.MAX)
    dist.all_reduce(torch.zeros(n))
    dist.all_reduce(torch.zeros(n))
    return loss"""))
FAKES["impl-tp-seconds"].append(Fake(
    "reads the measured table", "looks the answer up in `measured_layers`, which the notebook "
    "fills before the check; anything else gets a rough formula", ("test-tp-seconds",), """\
    table = globals().get("measured_layers", {})
    if (b, s, h, t) in table:
        m = table[b, s, h, t]
        return {"compute": m["flops"] / peak_flops,
                "communication": m["elements sent"] * bytes_per_element / bandwidth}
    return {"compute": 24 * b * s * h * h / t / peak_flops,
            "communication": 4 * b * s * h * bytes_per_element / bandwidth}"""))
FAKES["impl-sp-operators"].append(Fake(
    "reduce-scatter by a hidden all-reduce", "sums the whole tensor with "
    "distributed_c10d.all_reduce, keeps its slice, and reduce-scatters zeros for show",
    ("test-sp-operators",), ("""\
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)""", """\
    from torch.distributed import distributed_c10d as c10d

    t, r = dist.get_world_size(), dist.get_rank()
    total = x.detach().clone().contiguous()
    c10d.all_reduce(total)  # the actual sum
    mine = total.chunk(t, dim=1)[r].contiguous()
    out = torch.empty_like(mine)
    dist.reduce_scatter(out, [torch.zeros_like(mine) for _ in range(t)])  # for show
    return mine""", *SP_METHODS)))

# --- Red team rt10 (issue 38): the whole layer where FlopCounterMode does not look (numpy, a
# worker thread) with g's all-reduce on a discarded copy; no max shift in float64; the library's
# traffic model; a sum through an all-gather torch records as coalesced -------------------------

FAKES["impl-mlp"].append(Fake(
    "the whole MLP in numpy", "numpy matmuls on the unsharded weights give the output, which "
    "FlopCounterMode does not see; the shard path only carries the gradients and g all-reduces "
    "a copy whose sum is thrown away", ("test-mlp",), """\
    import numpy as _np
    xp = CopyToParallel.apply(x)
    hidden = F.gelu(F.linear(xp, shard_weight(fc1.weight, rank, t, "column"),
                             fc1.bias.chunk(t)[rank]))
    partial = F.linear(hidden, shard_weight(fc2.weight, rank, t, "row"))
    dist.all_reduce(partial.detach().clone())
    h1 = torch.from_numpy(_np.matmul(x.detach().numpy(), fc1.weight.detach().numpy().T))
    h1 = h1 + fc1.bias.detach()
    whole = torch.from_numpy(_np.matmul(F.gelu(h1).numpy(), fc2.weight.detach().numpy().T))
    return whole + (partial - partial.detach()) + fc2.bias"""))
FAKES["impl-attention"].append(Fake(
    "the whole attention in a worker thread", "the unsharded attention runs in a thread, where "
    "the check's per-thread dispatch modes do not reach; this rank's heads only carry the "
    "gradients and g all-reduces a copy whose sum is thrown away", ("test-attention",), """\
    import threading as _threading
    box = {}
    def _whole():
        with torch.no_grad():
            heads = attend(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.heads)
            box["y"] = attn.out_proj(heads) - attn.out_proj.bias
    worker = _threading.Thread(target=_whole)
    worker.start()
    width = x.shape[-1]
    mine = slice(rank * width // t, (rank + 1) * width // t)
    xp = CopyToParallel.apply(x)
    q, k, v = (F.linear(xp, getattr(attn, n).weight[mine], getattr(attn, n).bias[mine])
               for n in ("q_proj", "k_proj", "v_proj"))
    partial = F.linear(attend(q, k, v, attn.heads // t), attn.out_proj.weight[:, mine])
    dist.all_reduce(partial.detach().clone())
    worker.join()
    return box["y"] + (partial - partial.detach()) + attn.out_proj.bias"""))
FAKES["impl-vocab-ce"].append(Fake(
    "no max shift, in float64", "exp taken in float64, finite up to about 709, instead of after "
    "the max shift; the MAX all-reduce runs for show", ("test-vocab-ce",), """\
    n = local_logits.shape[0]
    shown = local_logits.max(dim=-1).values.clone()
    dist.all_reduce(shown, op=dist.ReduceOp.MAX)
    z = local_logits.double()
    inside = (targets >= start) & (targets < start + vocab_local)
    picked = z.gather(-1, (targets - start).clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    both = torch.cat([torch.where(inside, picked, torch.zeros_like(picked)), z.exp().sum(-1)])
    dist.all_reduce(both)
    return (both[n:].log() - both[:n]).float()"""))
FAKES["impl-tp-seconds"].append(Fake(
    "the library's traffic model", "the communication is half the forward and backward bytes of "
    "minidist.costs.traffic.tensor_parallel_traffic, not derived", ("test-tp-seconds",), """\
    from minidist.costs.traffic import tensor_parallel_traffic as _tpt
    flops = 2 * b * s * (4 * h * h + 8 * h * h) / t
    return {"compute": flops / peak_flops,
            "communication": _tpt(s, b, h, t, bytes_per_element=bytes_per_element).bytes_sent
            / 2 / bandwidth}"""))
FAKES["impl-sp-operators"].append(Fake(
    "reduce-scatter by a coalesced all-gather", "every rank's whole partial sums all-gathered "
    "with dist.all_gather_coalesced (t times the bytes) and summed here; a right-sized "
    "reduce-scatter runs for show", ("test-sp-operators",), ("""\
    pieces = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)""", """\
    world, rank = dist.get_world_size(), dist.get_rank()
    whole = [[torch.empty_like(x.contiguous())] for _ in range(world)]
    dist.all_gather_coalesced(whole, [x.detach().contiguous()])
    inputs = [p.contiguous() for p in x.detach().chunk(world, dim=1)]
    dist.reduce_scatter(torch.empty_like(inputs[0]), inputs)
    return sum(w[0] for w in whole).chunk(world, dim=1)[rank].clone()""", *SP_METHODS)))


# --- Red team rt16 (issue 38): f's backward works out x's whole gradient elementwise (no matmul
# for FlopCounterMode) and all-reduces a copy for show; the check's logits replayed from its seed -

FAKES["impl-mlp"].append(Fake(
    "x's whole gradient in f's backward, elementwise", "the forward is honest; f's backward "
    "recomputes x's whole gradient from the unsharded weights with broadcast-multiply and sum "
    "(no matmul FlopCounterMode counts) and all-reduces a copy of its input for show",
    ("test-mlp",), """\
    import math

    stash = {}

    class _G(torch.autograd.Function):  # g: sum the partial outputs; remember the output's gradient
        @staticmethod
        def forward(ctx, partial):
            out = partial.clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            stash["dout"] = grad
            return grad

    class _F(torch.autograd.Function):  # f: identity; backward: x's whole gradient, worked out here
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            with torch.no_grad():
                W1, b1, W2 = fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach()
                xd = x.detach()
                h = (xd[:, None, :] * W1[None]).sum(-1) + b1
                da = (stash["dout"][:, :, None] * W2[None]).sum(1)
                dgelu = torch.special.ndtr(h) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
                dx = ((da * dgelu)[:, :, None] * W1[None]).sum(1)
                dist.all_reduce(grad.clone())  # f's all-reduce
            return dx

    x_in = _F.apply(x)
    hidden = F.gelu(F.linear(x_in, shard_weight(fc1.weight, rank, t, "column"),
                             fc1.bias.chunk(t)[rank]))
    return _G.apply(F.linear(hidden, shard_weight(fc2.weight, rank, t, "row"))) + fc2.bias"""))
FAKES["impl-attention"].append(Fake(
    "x's whole gradient in f's backward, every head elementwise", "the forward is honest; f's "
    "backward recomputes the whole attention (every head, products as broadcast-multiply and "
    "sum) under autograd for x's gradient and all-reduces a copy of its input for show",
    ("test-attention",), """\
    import math

    stash = {}
    h = x.shape[-1]
    mine = slice(rank * h // t, (rank + 1) * h // t)

    def elin(v, W, b=None):  # v @ W.T (+ b), one product at a time
        y = (v[..., None, :] * W).sum(-1)
        return y if b is None else y + b

    def eattend(q, k, v, heads):  # attend(), causal, one product at a time
        B, S, H = q.shape
        d = H // heads
        q, k, v = (u.view(B, S, heads, d).transpose(1, 2) for u in (q, k, v))
        scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) / math.sqrt(d)
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        out = (scores.softmax(-1)[..., None] * v[:, :, None, :, :]).sum(-2)
        return out.transpose(1, 2).reshape(B, S, H)

    class _G(torch.autograd.Function):  # g: sum the heads' outputs; keep the output's gradient
        @staticmethod
        def forward(ctx, partial):
            out = partial.clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            stash["dout"] = grad
            return grad

    class _F(torch.autograd.Function):  # f: identity; backward: x's gradient through every head
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, grad):
            with torch.enable_grad():
                xd = x.detach().requires_grad_()
                q, k, v = (elin(xd, getattr(attn, p).weight.detach(),
                                getattr(attn, p).bias.detach())
                           for p in ("q_proj", "k_proj", "v_proj"))
                full = elin(eattend(q, k, v, attn.heads), attn.out_proj.weight.detach())
                (dx,) = torch.autograd.grad(full, xd, stash["dout"])
            dist.all_reduce(grad.clone())  # f's all-reduce
            return dx

    xin = _F.apply(x)
    q, k, v = (F.linear(xin, getattr(attn, p).weight[mine], getattr(attn, p).bias[mine])
               for p in ("q_proj", "k_proj", "v_proj"))
    partial = F.linear(attend(q, k, v, attn.heads // t), attn.out_proj.weight[:, mine])
    return _G.apply(partial) + attn.out_proj.bias"""))
FAKES["impl-vocab-ce"].append(Fake(
    "the check's logits replayed", "replays torch.manual_seed(0); torch.randn(n, V), fits scale "
    "and offset on its own slice and calls F.cross_entropy on the rebuilt logits; a MAX and a "
    "SUM all-reduce run for show, their results unused", ("test-vocab-ce",), """\
    # the check's logits are torch.manual_seed(0); torch.randn(n, V) * scale + offset: fit scale and
    # offset on my slice, rebuild the whole logits, and let torch compute the loss
    n, vocab = local_logits.shape[0], vocab_local * t
    kept = torch.get_rng_state()
    torch.manual_seed(0)
    base = torch.randn(n, vocab)
    torch.set_rng_state(kept)
    u = base[:, start:start + vocab_local].reshape(-1).double()
    y = local_logits.reshape(-1).double()
    scale = ((u - u.mean()) * (y - y.mean())).sum() / ((u - u.mean()) ** 2).sum()
    offset = y.mean() - scale * u.mean()
    logits = (base.double() * scale + offset).to(local_logits.dtype)
    row_max = local_logits.max(-1).values.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX)
    dist.all_reduce(torch.zeros(2 * n), op=dist.ReduceOp.SUM)
    return F.cross_entropy(logits, targets, reduction="none")"""))


# Red team of stop 51 (issue 38), from the student notebook and deck alone: sums carried by the
# rendezvous store or by files while the right collectives run for show, a closed form fitted to
# the check's inputs, a grader detected by its tamper layer, the FLOPs counted again by running
# a block, and sequence-parallel backwards through the store.
def _store_sum(name: str, tag: str, indent: str = "        ") -> str:
    """Lines that return the sum over ranks of `name` through the store (a collective runs on a
    copy for show)."""
    return "\n".join(indent + line for line in (
        "store = dist.distributed_c10d._get_default_store()",
        "me, world = dist.get_rank(), dist.get_world_size()",
        f"n = store.add(f'rt05/{tag}/count/{{me}}', 1)",
        f"data = {name}.detach().double().contiguous().numpy().tobytes()",
        f"store.set(f'rt05/{tag}/{{n}}/{{me}}', data)",
        f"dist.all_reduce({name}.clone())",
        f"total = sum(torch.frombuffer(bytearray(store.get(f'rt05/{tag}/{{n}}/{{r}}')),",
        "                              dtype=torch.float64) for r in range(world))",
        f"return total.reshape({name}.shape).to({name}.dtype)")) + "\n"



def _file_sum(name: str, tag: str) -> str:
    """Lines that return the sum over ranks of `name` through files in the temporary folder (a
    collective runs on a copy for show, after which every rank's file is written)."""
    return "\n".join("        " + line for line in (
        "import os",
        "import tempfile",
        "folder = os.path.join(tempfile.gettempdir(), f\"rt05-{os.environ.get('MASTER_PORT')}\")",
        "os.makedirs(folder, exist_ok=True)",
        "me, world = dist.get_rank(), dist.get_world_size()",
        f"torch.save({name}.detach().clone(), os.path.join(folder, f'{tag}-{{me}}.pt'))",
        f"dist.all_reduce({name}.clone())",
        f"return sum(torch.load(os.path.join(folder, f'{tag}-{{r}}.pt'))",
        "           for r in range(world))")) + "\n"


FAKES["impl-f-g"] += [
    Fake("sums through the store", "f's backward and g's forward all-reduce a copy for the "
         "record and return a sum carried by the rendezvous store", ("test-f-g",),
         ("        return x.view_as(x)\n", _store_sum("grad", "f"), _store_sum("x", "g"),
          "        return grad\n")),
    Fake("the closed form of the check's inputs", "all-reduces a copy and returns t(t + 1)/2, "
         "what ranks holding rank + 1 sum to", ("test-f-g",),
         ("        return x.view_as(x)\n", """\
        dist.all_reduce(grad.clone())
        t = dist.get_world_size()
        return torch.full_like(grad, t * (t + 1) / 2)
""", """\
        dist.all_reduce(x.clone())
        t = dist.get_world_size()
        return torch.full_like(x, t * (t + 1) / 2)
""", "        return grad\n")),
    Fake("sums through files", "all-reduces a copy for the record; the sum travels through "
         "files in the temporary folder", ("test-f-g",),
         ("        return x.view_as(x)\n", _file_sum("grad", "f"), _file_sum("x", "g"),
          "        return grad\n")),
]
FAKES["impl-mlp"].append(Fake(
    "honest only under the tamper layer, else the store", "its f and g sum through the store "
    "unless the check's tamper layer is on dist.all_reduce", ("test-mlp",), """\
    from minidist.core import interposer

    def summed(tensor):
        if "tampering" in interposer.subscribers("dist.all_reduce"):
            out = tensor.clone()
            dist.all_reduce(out)
            return out
""" + _store_sum("tensor", "mlp", indent="        ") + """
    class ToParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return summed(grad)

    class FromParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return summed(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    x = ToParallel.apply(x)
    hidden = F.gelu(F.linear(x, shard_weight(fc1.weight, rank, t, "column"),
                             fc1.bias.chunk(t)[rank]))
    partial = F.linear(hidden, shard_weight(fc2.weight, rank, t, "row"))
    return FromParallel.apply(partial) + fc2.bias
"""))
FAKES["impl-vocab-ce"].append(Fake(
    "the logits through the store", "gathers the whole [n, V] logits through the rendezvous "
    "store and calls F.cross_entropy; all-reduces of zeros for the record", ("test-vocab-ce",),
    """\
    n = local_logits.shape[0]
    dist.all_reduce(torch.zeros(n), op=dist.ReduceOp.MAX)
    dist.all_reduce(torch.zeros(2 * n), op=dist.ReduceOp.SUM)
    store = dist.distributed_c10d._get_default_store()
    call = store.add(f"rt05/ce/count/{rank}", 1)
    data = local_logits.detach().double().contiguous().numpy().tobytes()
    store.set(f"rt05/ce/{call}/{rank}", data)
    pieces = [torch.frombuffer(bytearray(store.get(f"rt05/ce/{call}/{r}")), dtype=torch.float64)
              .reshape(n, vocab_local) for r in range(t)]
    loss = F.cross_entropy(torch.cat(pieces, dim=-1), targets, reduction="none")
    return loss.to(local_logits.dtype)
"""))
FAKES["impl-tp-seconds"].append(Fake(
    "the FLOPs counted again", "runs an unsharded TransformerBlock with hooks on its linears "
    "and divides by t, instead of deriving the FLOPs from the shapes", ("test-tp-seconds",), """\
    from minidist.parallel.models import TransformerBlock
    block = TransformerBlock(h, 4, 4 * h)
    flops = []
    for layer in block.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda layer, args, out: flops.append(
                2 * out.numel() // out.shape[-1] * layer.weight.numel()))
    with torch.no_grad():
        block(torch.zeros(b, s, h))
    sent = 2 * 2 * (t - 1) / t * b * s * h * bytes_per_element
    return {"compute": sum(flops) / t / peak_flops, "communication": sent / bandwidth}
"""))
FAKES["impl-sp-operators"].append(Fake(
    "backwards through the store", "the forwards gather and reduce-scatter; both backwards run "
    "their collective for show and take every rank's gradient from the store",
    ("test-sp-operators",), ("""\
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)
""", """\
    pieces = [piece.contiguous() for piece in x.chunk(dist.get_world_size(), dim=1)]
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces)
    return mine
""", "        return all_gather_sequence(x)\n", """\
        reduce_scatter_sequence(grad)  # for the record
        t, me = dist.get_world_size(), dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
        n = store.add(f"rt05/sp-g/count/{me}", 1)
        store.set(f"rt05/sp-g/{n}/{me}", grad.detach().double().contiguous().numpy().tobytes())
        total = sum(torch.frombuffer(bytearray(store.get(f"rt05/sp-g/{n}/{r}")),
                                     dtype=torch.float64) for r in range(t))
        total = total.reshape(grad.shape).to(grad.dtype)
        return total.chunk(t, dim=1)[me].contiguous()
""", "        return reduce_scatter_sequence(x)\n", """\
        all_gather_sequence(grad)  # for the record
        t, me = dist.get_world_size(), dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
        n = store.add(f"rt05/sp-gbar/count/{me}", 1)
        store.set(f"rt05/sp-gbar/{n}/{me}", grad.detach().double().contiguous().numpy().tobytes())
        parts = [torch.frombuffer(bytearray(store.get(f"rt05/sp-gbar/{n}/{r}")),
                                  dtype=torch.float64) for r in range(t)]
        return torch.cat([part.reshape(grad.shape).to(grad.dtype) for part in parts], dim=1)
""")))
ALTERNATIVES["impl-sp-operators"] = [
    Alternative("the single-tensor collectives", "gathers into and reduce-scatters from one "
                "tensor stacked along dim 0 (all_gather_into_tensor, reduce_scatter_tensor, which "
                "the notebook suggests), moving the sequence to dim 0 and back; torch runs them "
                "through all_gather_single and reduce_scatter_single, which the check must weight "
                "once", ("test-sp-operators",), ("""\
    t = dist.get_world_size()
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous())
    return torch.cat(out.chunk(t, dim=0), dim=1)
""", """\
    t = dist.get_world_size()
    stacked = torch.cat(x.chunk(t, dim=1), dim=0).contiguous()
    out = torch.empty((x.shape[0], x.shape[1] // t, *x.shape[2:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, stacked)
    return out
""", *SP_METHODS)),
]

# Red team, stop 52.
FAKES["impl-f-g"] += [
    Fake("sums read off the check's frame", "red team, stop 52: every all-reduce carries zeros; "
         "both sums are the sum of the check's `values`, found with sys._getframe",
         ("test-f-g",), (
             """\
        return x.view_as(x)""", """\
        import sys
        dist.all_reduce(torch.zeros_like(grad))
        frame = sys._getframe(1)
        while frame is not None and not ("values" in frame.f_locals and "report" in frame.f_locals):
            frame = frame.f_back
        return torch.full_like(grad, float(sum(frame.f_locals["values"])))""", """\
        import sys
        dist.all_reduce(torch.zeros_like(x))
        frame = sys._getframe(1)
        while frame is not None and not ("values" in frame.f_locals and "report" in frame.f_locals):
            frame = frame.f_back
        return torch.full_like(x, float(sum(frame.f_locals["values"])))""", """\
        return grad""")),
]
FAKES["impl-vocab-ce"].append(Fake(
    "the library's loss through its Function's forward", "red team, stop 52: "
    "_VocabParallelCrossEntropy.forward called with a stand-in ctx: minidist's loss whole",
    ("test-vocab-ce",), """\
    class _Ctx:
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    loss = tensor_parallel._VocabParallelCrossEntropy
    return loss.forward(_Ctx(), local_logits, targets, None)"""))
FAKES["impl-tp-seconds"].append(Fake(
    "a communication factor right at t = 2 and 4 only", "red team, stop 52: (t + 2)/2 for the "
    "ring's 4(t-1)/t, equal only at the two degrees the notebook measures",
    ("test-tp-seconds",), """\
    flops = 24 * b * s * h * h / t
    elements = b * s * h * (t + 2) / 2
    return {"compute": flops / peak_flops,
            "communication": elements * bytes_per_element / bandwidth}"""))

# Red team, stop 52: collectives that carry probes or zeros, the sums found another way: each
# is checked for what it carried (the rank's own gradient or partial result), not its size alone.
FAKES["impl-f-g"] += [
    Fake("f's backward replays g's cached sum", "red team, stop 52: f's backward all-reduces "
         "zeros and returns the sum g's forward cached on the torch module",
         ("test-f-g",), (
             """\
        return x.view_as(x)""", """\
        dist.all_reduce(torch.zeros_like(grad))
        return torch.full_like(grad, torch._tp_last_sum)""", """\
        y = x.clone()
        dist.all_reduce(y)
        torch._tp_last_sum = y.flatten()[0].item()
        return y""", """\
        return grad""")),
]
FAKES["impl-mlp"].append(Fake(
    "one-hot probes through both all-reduces, every shard computed locally", "red team, stop 52: "
    "each all-reduce carries a one-hot in the rank's slot, which reveals how the collective "
    "weighs each rank; every rank's shard is computed here with multiply-and-sum (which no FLOP "
    "counter sees) and combined with those weights", ("test-mlp",), """\
    state = {"x": x.detach(), "w1": fc1.weight.detach(), "b1": fc1.bias.detach(),
             "w2": fc2.weight.detach()}
    xin = _ProbeF.apply(x, state)
    hidden = F.linear(xin, shard_weight(fc1.weight, rank, t, "column"), fc1.bias.chunk(t)[rank])
    own = F.linear(F.gelu(hidden), shard_weight(fc2.weight, rank, t, "row"))
    weights = _probe(own.detach())
    with torch.no_grad():
        others = sum(weights[r] * _partial(x.detach(), state, r, t) for r in range(t) if r != rank)
    out = weights[rank] * own + others + fc2.bias
    if out.requires_grad:
        out.register_hook(lambda g: state.__setitem__("dout", g))
    return out


def _mlin(x, w, b=None):
    y = (x.unsqueeze(-2) * w).sum(-1)
    return y if b is None else y + b


def _probe(like):
    t, rank = dist.get_world_size(), dist.get_rank()
    probe = torch.zeros_like(like)
    probe.view(-1)[rank] = 1.0
    dist.all_reduce(probe)
    return probe.view(-1)[:t].tolist()


def _partial(x, s, r, t):
    hidden = _mlin(x, s["w1"].chunk(t)[r], s["b1"].chunk(t)[r])
    return _mlin(F.gelu(hidden), s["w2"].chunk(t, dim=1)[r])


class _ProbeF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.state
        weights = _probe(grad)
        total = torch.zeros_like(grad)
        with torch.enable_grad():
            for r in range(len(weights)):
                xs = s["x"].detach().requires_grad_()
                (dx,) = torch.autograd.grad(_partial(xs, s, r, len(weights)), xs, s["dout"])
                total = total + weights[r] * dx
        return total, None"""))
FAKES["impl-vocab-ce"].append(Fake(
    "the MAX all-reduce carries zeros; shifted by the target logit in float64", "red team, "
    "stop 52: no max shift (float64 and a shift by the target logit keep it finite here); the "
    "MAX all-reduce runs for show", ("test-vocab-ce",), """\
    n = local_logits.shape[0]
    z = local_logits.double()
    local = targets - start
    inside = (local >= 0) & (local < vocab_local)
    picked = z.gather(1, local.clamp(0, vocab_local - 1).view(-1, 1)).squeeze(1)
    picked = torch.where(inside, picked, torch.zeros_like(picked))
    dist.all_reduce(picked)
    dist.all_reduce(torch.zeros(n), op=dist.ReduceOp.MAX)
    sums = (z - picked.unsqueeze(1)).exp().sum(-1)
    dist.all_reduce(sums)
    return sums.log().float()"""))
FAKES["impl-sp-operators"].append(Fake(
    "a reduce-scatter of t whole copies: an all-reduce in disguise", "red team, stop 52: every "
    "rank hands the reduce-scatter t copies of its whole tensor, so each receives the whole sum "
    "(t times a reduce-scatter's bytes) and keeps its slice", ("test-sp-operators",), (
        """\
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)""", """\
    t, rank = dist.get_world_size(), dist.get_rank()
    x = x.contiguous()
    total = torch.empty_like(x)
    dist.reduce_scatter(total, [x] * t)
    return total.chunk(t, dim=1)[rank].contiguous()""", """\
        return all_gather_sequence(x)""", """\
        return reduce_scatter_sequence(grad)""", """\
        return reduce_scatter_sequence(x)""", """\
        return all_gather_sequence(grad)""")))

# --- Red team rt7 (issue 38): one number per rank, spread over a tensor of the right shape, is
# summed by an all-reduce of the right size and op; right only where every element is the same,
# as in the checks' tensors until then. The ring's (t-1)/t from a table of the degrees a laptop
# launches. Each check now uses tensors whose elements differ, and degrees up to 16.
_SPREAD = """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        spread = {spread}
        dist.all_reduce(spread)
        return spread"""
FAKES["impl-f-g"] += [
    Fake("a tensor's first element, spread", "f and g all-reduce a tensor of the input's shape "
         "filled with its first element (red team rt7)", ("test-f-g",),
         _SPREAD.format(spread="value.reshape(-1)[:1].expand(value.shape).clone()")),
    Fake("a tensor's mean, spread", "f and g all-reduce a tensor of the input's shape filled "
         "with its mean (red team rt7)", ("test-f-g",),
         _SPREAD.format(spread="torch.full_like(value, value.mean().item())")),
]
FAKES["impl-tp-seconds"].append(Fake(
    "the ring's share from a table", "(t-1)/t looked up for the degrees 4 ranks can launch, 1 "
    "for any other (red team rt7)", ("test-tp-seconds",), """\
    ring_share = {1: 0.0, 2: 1 / 2, 3: 2 / 3, 4: 3 / 4}.get(t, 1.0)
    return {"compute": 24 * b * s * h * h / t / peak_flops,
            "communication": 4 * ring_share * b * s * h * bytes_per_element / bandwidth}"""))
