"""Fakes of Lab 05's exercises: the right numbers without the sharding or the collectives they
teach. impl-f-g has four solution regions (the forward and backward of f and g) that each get
the same fake source, so its fakes pick their branch by the method they run in."""

from fakes import Fake

FAKES = {
    "impl-shard": [
        Fake("halves the weight", "ignores t: always two pieces, right only for t = 2",
             ("test-shard",), """\
    return weight.chunk(2, dim=0 if kind == "column" else 1)[rank]"""),
        Fake("a slice of W transposed", "slices a full transposed copy: the shard keeps the whole "
             "copy's storage alive", ("test-shard",), """\
    columns = weight.t().contiguous()  # W^T, the math's matrix: column = its dim 1
    return columns.chunk(t, dim=1 if kind == "column" else 0)[rank].t()"""),
    ],
    "impl-f-g": [
        Fake("sums by all-gather", "all-gathers every rank's tensor and sums locally instead of "
             "one all-reduce", ("test-f-g", "test-mlp"), """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        pieces = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, value.contiguous())
        return torch.stack(pieces).sum(dim=0)"""),
        Fake("the library's f and g", "delegates the all-reduces to tensor_parallel's own "
             "operators", ("test-f-g", "test-mlp"), """\
        import sys
        method = sys._getframe().f_code.co_qualname
        value = locals().get("x", locals().get("grad"))
        if method in ("CopyToParallel.forward", "ReduceFromParallel.backward"):
            return value
        return tensor_parallel.ReduceFromParallel.apply(value.clone(), None)"""),
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
    ],
}
