"""Fakes of Lab 06's exercises: derivations that ignore a parameter the first example cannot
see, or that ask the library's formulas or time the schedule with the simulator's own loop
(pipeline_simulator._run) instead, schedules that lean on the library or get Megatron's order
wrong, executors that do not run the rank's list as written, and a send-against-compute count
that drops a parameter.
impl-bubble-formulas has two solution regions (one per function) that each get the same fake
source, so its fakes pick their formula by the function they run in. The first fake of each
exercise behaves correctly outside its own checks, so that the other cells of the submission
it shares score as the solution's."""

from fakes import Fake

FAKES = {
    "impl-bubble-formulas": [
        Fake("the naive bubble", "bubble_of_total ignores m: (p-1)/p, right for one microbatch",
             ("test-bubble-formulas",), """\
    import sys
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return (p - 1) / p
    return (p - 1) / m"""),
        Fake("four stages", "bubble_relative_to_ideal ignores p: 3/m, right for p = 4",
             ("test-bubble-formulas",), """\
    import sys
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return (p - 1) / (m + p - 1)
    return 3 / m"""),
        Fake("the library's formulas", "returns minidist.costs.bubbles' GPipe bubble, both forms",
             ("test-bubble-formulas",), """\
    import sys
    from minidist.costs import bubbles
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return bubbles.bubble_fraction("gpipe", p, m)
    return bubbles.bubble_relative_to_ideal("gpipe", p, m)"""),
        Fake("the simulator's insides", "times GPipe with the simulator's own loop, "
             "pipeline_simulator._run, and reads its Timeline: simulate's two lines, no derivation",
             ("test-bubble-formulas",), """\
    import sys
    from minidist.parallel.pipeline import Schedule
    compute = [[Action("F", rank, j) for j in range(m)] + [Action("B", rank, j) for j in range(m)]
               for rank in range(p)]
    gpipe = Schedule.from_compute("gpipe", compute, m)
    costs = Costs()
    events = pipeline_simulator._run(gpipe, lambda rank, action: costs.of(action, False), 0.0)
    timeline = Timeline(gpipe, events)
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return timeline.bubble_fraction
    return (timeline.makespan - 3 * m) / (3 * m)"""),
    ],
    "impl-1f1b": [
        Fake("the library's 1F1B", "takes each rank's actions from pipeline.schedule('1f1b')",
             ("test-1f1b",), """\
        actions = pipeline.schedule("1f1b", p, m).compute(rank)"""),
        Fake("a warm-up of p-1-rank", "ignores m in the warm-up: wrong when m < p - 1 - rank",
             ("test-1f1b",), """\
        warmup = p - 1 - rank
        actions = [Action("F", rank, j) for j in range(warmup)]
        for j in range(m - warmup):
            actions += [Action("F", rank, warmup + j), Action("B", rank, j)]
        actions += [Action("B", rank, j) for j in range(m - warmup, m)]"""),
        Fake("a round trip of warm-up", "derives the warm-up from the first backward's round "
             "trip, min(2(p-1-rank), m): legal, GPipe's bubble, but more in flight than 1F1B",
             ("test-1f1b",), """\
        warmup = min(2 * (p - 1 - rank), m)
        actions = [Action("F", rank, j) for j in range(warmup)]
        for j in range(m - warmup):
            actions += [Action("F", rank, warmup + j), Action("B", rank, j)]
        actions += [Action("B", rank, j) for j in range(m - warmup, m)]"""),
    ],
    "impl-executor": [
        Fake("the library's executor", "hands the rank's list to pipeline_exec.execute",
             ("test-executor",), """\
    trace = pipeline_exec.execute(schedule, {rank: stage}, inputs, targets, loss_fn)
    return [loss for loss in trace.losses]"""),
        Fake("GPipe whatever the list says", "runs every forward, then every backward, with the "
             "right messages and gradients, ignoring the schedule's order", ("test-executor",),
             """\
    received, outputs, losses, sends = {}, {}, [], []
    for j in range(m):
        if rank > 0:
            received[j] = torch.empty(activation_shape)
            dist.recv(received[j], src=rank - 1)
            received[j].requires_grad_()
        out = stage(xs[j] if rank == 0 else received[j])
        if rank == last:
            loss = loss_fn(out, ys[j])
            losses.append(loss.item())
            out = loss / m
        else:
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        outputs[j] = out
    for j in range(m):
        grad = None
        if rank < last:
            grad = torch.empty(activation_shape)
            dist.recv(grad, src=rank + 1)
        outputs[j].backward(grad)
        if rank > 0:
            sends.append(dist.isend(received[j].grad, dst=rank - 1))
    for request in sends:
        request.wait()
    return losses"""),
        Fake("keeps no activations", "runs each forward without autograd and again inside the "
             "backward (recompute): right gradients, but compute the list does not have",
             ("test-executor",), """\
    received, kept, output_grads, losses, sends = {}, {}, {}, [], []
    for action in schedule.actions[rank]:
        j = action.microbatch
        if action.kind in ("RECV_F", "RECV_B"):
            buffer = torch.empty(activation_shape)
            dist.recv(buffer, src=peer(schedule, action))
            if action.kind == "RECV_F":
                received[j] = buffer.requires_grad_()
            else:
                output_grads[j] = buffer
        elif action.kind == "F":
            x = xs[j] if rank == 0 else received[j]
            with torch.no_grad():
                out = stage(x)
                if rank == last:
                    losses.append(loss_fn(out, ys[j]).item())
            kept[j] = out
        elif action.kind == "SEND_F":
            sends.append(dist.isend(kept[j], dst=peer(schedule, action)))
        elif action.kind == "B":
            out = stage(xs[j] if rank == 0 else received[j])
            if rank == last:
                (loss_fn(out, ys[j]) / m).backward()
            else:
                out.backward(output_grads.pop(j))
        elif action.kind == "SEND_B":
            sends.append(dist.isend(received.pop(j).grad, dst=peer(schedule, action)))
    for request in sends:
        request.wait()
    return losses"""),
    ],
    "impl-pp-times": [
        Fake("bf16 always", "ignores bytes_per_element: 2 bytes, right for bf16",
             ("test-pp-times",), """\
    send = b * s * h * 2 / bandwidth
    forward = layers_per_stage * 24 * b * s * h * h / peak_flops
    return {"send": send, "forward": forward}"""),
        Fake("one layer per stage", "ignores layers_per_stage: the forward of one layer",
             ("test-pp-times",), """\
    send = b * s * h * bytes_per_element / bandwidth
    forward = 24 * b * s * h * h / peak_flops
    return {"send": send, "forward": forward}"""),
        Fake("the MLP only", "counts the MLP's matmuls (16bsh²) and forgets attention's four "
             "projections", ("test-pp-times",), """\
    send = b * s * h * bytes_per_element / bandwidth
    forward = layers_per_stage * 16 * b * s * h * h / peak_flops
    return {"send": send, "forward": forward}"""),
    ],
    "impl-interleaved": [
        Fake("the library's schedule", "takes each rank's actions from "
             "pipeline.schedule('interleaved')", ("test-interleaved",), """\
        actions = pipeline.schedule("interleaved", p, m, chunks=v).compute(rank)"""),
        Fake("chunks one after the other", "every microbatch through chunk 0, then through "
             "chunk 1 (groups of m, not p): legal, but neither Megatron's order nor its memory",
             ("test-interleaved",), """\
        def step(i, backward):
            chunk, j = divmod(i, m)
            if backward:
                chunk = v - 1 - chunk
            return Action("B" if backward else "F", chunk * p + rank, j)

        total = m * v
        warmup = min((v - 1) * m + 2 * (p - 1 - rank), total)
        actions = [step(i, False) for i in range(warmup)]
        for i in range(total - warmup):
            actions += [step(warmup + i, False), step(i, True)]
        actions += [step(i, True) for i in range(total - warmup, total)]"""),
        Fake("1F1B's warm-up", "counts the warm-up as if there were one chunk, 2(p-1-rank), "
             "forgetting the (v-1)p forwards of the other chunks",
             ("test-interleaved",), """\
        def step(i, backward):
            group, within = divmod(i, p * v)
            chunk, offset = divmod(within, p)
            if backward:
                chunk = v - 1 - chunk
            return Action("B" if backward else "F", chunk * p + rank, group * p + offset)

        total = m * v
        warmup = min(2 * (p - 1 - rank), total)
        actions = [step(i, False) for i in range(warmup)]
        for i in range(total - warmup):
            actions += [step(warmup + i, False), step(i, True)]
        actions += [step(i, True) for i in range(total - warmup, total)]"""),
        Fake("backwards in the forwards' chunk order", "runs the backwards through chunk 0 "
             "first, as the forwards do, instead of from the last stage",
             ("test-interleaved",), """\
        def step(i, backward):
            group, within = divmod(i, p * v)
            chunk, offset = divmod(within, p)
            return Action("B" if backward else "F", chunk * p + rank, group * p + offset)

        total = m * v
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
        actions = [step(i, False) for i in range(warmup)]
        for i in range(total - warmup):
            actions += [step(warmup + i, False), step(i, True)]
        actions += [step(i, True) for i in range(total - warmup, total)]"""),
    ],
    "impl-zb-idle": [
        Fake("p - 1 forwards", "ignores T_B and T_W: (p-1)·T_F, right when all are 1",
             ("test-zb-idle",), """\
    return (p - 1) * t_f"""),
        Fake("a third of 1F1B's", "(p-1)(T_F+T_B+T_W)/3: right only when the three are equal",
             ("test-zb-idle",), """\
    return (p - 1) * (t_f + t_b + t_w) / 3"""),
        Fake("the library's ZB-H1 bubble", "returns minidist.costs.bubbles.bubble_time('zb-h1')",
             ("test-zb-idle",), """\
    from minidist.costs import bubbles
    return bubbles.bubble_time("zb-h1", p, 2 * p, costs=(t_f, t_b, t_w))[0]"""),
        Fake("the simulator's insides", "times the library's ZB-H1 order (pipeline._zb_h1) "
             "with the simulator's own loop, pipeline_simulator._run: measured, not derived",
             ("test-zb-idle",), """\
    m = 2 * p
    order = [pipeline._zb_h1(rank, p, m) for rank in range(p)]
    zb = pipeline.Schedule.from_compute("zb-h1", order, m)
    costs = Costs(F=t_f, B=t_b, W=t_w)
    events = pipeline_simulator._run(zb, lambda rank, action: costs.of(action, True), 0.0)
    return Timeline(zb, events).makespan - m * (t_f + t_b + t_w)"""),
    ],
}
