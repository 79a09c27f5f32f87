"""Fakes of Lab 02's exercises: the visible numbers without the formula's dependence on every
parameter, without measuring, or from the library."""

from fakes import Fake

FAKES = {
    "impl-zero-bytes": [
        Fake("the library's model state", "delegates to minidist.memory.model_state_bytes",
             ("test-zero-bytes",), """\
    return memory.model_state_bytes(num_params, zero_stage, dp).total"""),
        Fake("ZeRO's figure, N = 64 built in", "ignores dp: divides by the visible test's 64",
             ("test-zero-bytes",), """\
    params, grads, optimizer = 2 * num_params, 2 * num_params, 12 * num_params
    if zero_stage >= 1:
        optimizer /= 64
    if zero_stage >= 2:
        grads /= 64
    if zero_stage >= 3:
        params /= 64
    return params + grads + optimizer"""),
    ],
    "impl-held-bytes": [
        Fake("bytes per tensor", "counts numel x element size of each tensor, not each storage "
             "once and whole", ("test-held-bytes",), """\
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    mine = {id(p) for p in params}
    masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    return (sum(t.nbytes for t in params), sum(t.nbytes for t in grads),
            sum(t.nbytes for t in masters + states))"""),
        Fake("no master copies", "counts the optimizer's state but not the fp32 masters it "
             "updates", ("test-held-bytes",), """\
    def total(tensors):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    return total(params), total(grads), total(states)"""),
        Fake("the library's footprint", "delegates to minidist.footprint.model_state_footprint",
             ("test-held-bytes",), """\
    held = footprint.model_state_footprint(model, optimizer)
    return held.params, held.grads, held.optimizer"""),
    ],
    "impl-activation-bytes": [
        Fake("the library's activations", "delegates to minidist.memory.activation_bytes",
             ("test-activation-bytes",), """\
    return memory.activation_bytes(s, b, h, a, tp, sequence_parallel, recompute)"""),
        Fake("no sequence parallelism", "ignores sequence_parallel: the visible test never sets "
             "it", ("test-activation-bytes",), """\
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    attention = 0 if recompute == "selective" else 5 * a * s / (h * tp)
    return sbh * (10 + 24 / tp + attention)"""),
        Fake("the attention core whole on every rank", "5as/h not divided by t: the visible "
             "test has it only at t = 1", ("test-activation-bytes",), """\
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / tp if sequence_parallel else 2 * sbh
    attention = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 / tp + attention)
    return sbh * (10 + 24 / tp + attention)"""),
    ],
    "impl-saved-bytes": [
        Fake("pack keeps nothing for backward", "counts the right storages but its pack hook "
             "returns None, so backward breaks", ("test-saved-bytes",), """\
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed):
        module(x)
    return sum(storages.values())"""),
        Fake("the block's formula", "measures nothing: predicts the bytes of a TransformerBlock "
             "with flash attention from x's shape", ("test-saved-bytes",), """\
    module(x)
    b, s, h = x.shape
    heads = next(part.heads for part in module.modules() if hasattr(part, "heads"))
    element = x.element_size()
    return 16 * s * b * h * element + 2 * 2 * s * b * element + heads * s * b * 4"""),
        Fake("the library's measurement", "delegates to minidist.footprint.saved_activations",
             ("test-saved-bytes",), """\
    return sum(t.nbytes for t in footprint.saved_activations(module, x))"""),
    ],
    "impl-bubble": [
        Fake("the simulator's bubble", "measures minidist.pipeline's simulated timeline "
             "instead of the formula", ("test-bubble",), """\
    return pipeline.simulate(pipeline.schedule(schedule, p, m, v)).bubble_fraction"""),
        Fake("no interleaving", "ignores v: the visible test has no interleaved schedule",
             ("test-bubble",), """\
    ideal = 3 * m
    bubble = p - 1 if schedule == "zb-h1" else 3 * (p - 1)
    return bubble / (ideal + bubble)"""),
        Fake("ZB-H1 like 1F1B", "ignores the split backward: ZB-H1's bubble taken as 1F1B's",
             ("test-bubble",), """\
    bubble = 3 * (p - 1) / v if schedule == "interleaved" else 3 * (p - 1)
    return bubble / (3 * m + bubble)"""),
    ],
    "impl-dp-bytes": [
        Fake("ZeRO-3 like DDP", "two passes for every stage: the misstatement that ZeRO-3 "
             "communicates like DDP", ("test-dp-bytes",), """\
    return 2 * (dp - 1) / dp * num_params * bytes_per_element"""),
        Fake("bf16 built in", "ignores bytes_per_element: the visible test uses the default 2",
             ("test-dp-bytes",), """\
    one_pass = (dp - 1) / dp * num_params * 2
    return 3 * one_pass if zero_stage == 3 else 2 * one_pass"""),
        Fake("the library's traffic", "delegates to minidist.traffic.data_parallel_traffic",
             ("test-dp-bytes",), """\
    return data_parallel_traffic(num_params, dp, zero_stage, bytes_per_element).bytes_sent"""),
    ],
    "impl-mfu": [
        Fake("one GPU", "ignores num_gpus: the visible test uses the default 1",
             ("test-mfu",), """\
    return tokens_per_second * (6 * num_params + 12 * layers * hidden * seq_len) / peak_flops"""),
        Fake("the library's MFU", "delegates to minidist.flops.mfu", ("test-mfu",), """\
    return flops.mfu(tokens_per_second, num_params, layers, hidden, seq_len, peak_flops,
                     num_gpus)"""),
        Fake("attention without the sequence", "12·L·h per token: the visible test has s = 1",
             ("test-mfu",), """\
    flops_per_token = 6 * num_params + 12 * layers * hidden
    return tokens_per_second * flops_per_token / (num_gpus * peak_flops)"""),
    ],
}
