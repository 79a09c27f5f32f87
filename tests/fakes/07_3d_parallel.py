"""Fakes of Lab 07's exercises: mesh arithmetic that holds for three dimensions only or copies
torch's groups of the layouts shown, groups made by the library, by torch's DeviceMesh or by
each rank alone, expert dispatch that sends more than each expert's tokens or computes every
token at home, byte formulas that drop a direction or an element size or let a lone stage send,
a 3D step without microbatches, without tensor parallelism or with the shown layout's peers,
and a planner's cost function that asks the library, puts every group on NVLink, or never hides
the data-parallel reduction.
impl-3d-step has two solution regions (one per function) that each get the same fake source,
so its fakes pick their branch by the function they run in."""

from fakes import Fake, edited, solution_region

_STAGE = """\
    import sys
    if sys._getframe().f_code.co_name == "tensor_parallel_stage":
"""

_GPIPE = """\
    inputs, outputs = [], []
    for x, y in zip(ids.chunk(microbatches), targets.chunk(microbatches)):
        if not first:
            x = torch.empty(activation_shape)
            dist.recv(x, src=pp_ranks[stage_index - 1])
            x.requires_grad_()
        out = stage(x)
        if last:
            out = lm_loss(out, y) / microbatches
        else:
            dist.send(out.detach(), dst=pp_ranks[stage_index + 1])
        inputs.append(x)
        outputs.append(out)
    for x, out in zip(inputs, outputs):
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=pp_ranks[stage_index + 1])
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=pp_ranks[stage_index - 1])
    return sum(out.item() for out in outputs) if last else None"""

# impl-layout-cost as the solution writes it, with one piece swapped by each fake below
_COST = """\
    def link(span):
        if span <= cluster.gpus_per_node:
            return cluster.intra_node_latency, 1 / cluster.intra_node_bandwidth
        return cluster.inter_node_latency, 1 / cluster.inter_node_bandwidth

    state = memory.model_state_bytes(model.num_params / (tp * pp), layout.zero_stage, dp)
    per_layer = memory.activation_bytes(s, b, h, model.heads, tp, tp > 1, layout.recompute)
    whole_layer = memory.activation_bytes(s, b, h, model.heads, tp, tp > 1, None)
    held = []
    for rank in {0, pp - 1}:
        inflight = bubbles.inflight_microbatches(layout.schedule, pp, m, rank, v)
        activations = inflight * L / (pp * v) * per_layer + whole_layer - per_layer
        if rank == pp - 1:
            activations += 4 * s * b * model.vocab / tp
        held.append(state.params + state.grads + state.optimizer + activations)
    gpus = tp * pp * dp
    flops_per_token = flops.hardware_flops_per_token(model.num_params, L, h, s, layout.recompute)
    compute = global_batch * s * flops_per_token / (gpus * cluster.peak_flops * efficiency)
    bubble = compute * (pp - 1) / (v * m)
    activation = b * s * h * 2
    tp_time = pp_time = dp_time = 0.0
    if tp > 1:
        repeats = 1.5 if layout.recompute == "full" else 1.0
        per_layer_time = 4 * cost.collective_time("all_reduce", activation, tp, *link(tp))
        tp_time = per_layer_time * repeats * L / pp * m
    if pp > 1:
        pp_time = 2 * m * v * cost.collective_time("send", activation / tp, 2, *link(gpus))
    if dp > 1:
        grads = model.num_params / (tp * pp) * 2
        backward = 2 / 3 * compute / m
        reduce = "all_reduce" if layout.zero_stage == 0 else "reduce_scatter"
        dp_time = max(0.0, cost.collective_time(reduce, grads, dp, *link(tp * dp)) - backward)
        if layout.zero_stage == 1:
            dp_time += cost.collective_time("all_gather", grads, dp, *link(tp * dp))
    return {"memory": max(held), "compute": compute, "bubble": bubble, "tp": tp_time,
            "pp": pp_time, "dp": dp_time}"""

FAKES = {
    "impl-mesh-groups": [
        Fake("the library's groups", "returns minidist.communication.mesh.group_ranks",
             ("test-mesh-groups",), """\
    from minidist.communication import mesh
    return mesh.group_ranks(shape, dim)"""),
        Fake("three nested loops", "works for three dimensions only: any order, but not two or "
             "four", ("test-mesh-groups",), """\
    names = list(shape)
    a, b, c = shape.values()
    groups = {}
    for i in range(a):
        for j in range(b):
            for k in range(c):
                coords = dict(zip(names, (i, j, k)))
                key = tuple(value for name, value in coords.items() if name != dim)
                groups.setdefault(key, []).append((i * b + j) * c + k)
    return sorted(groups.values())"""),
        Fake("torch's groups, copied", "reads the groups from the notebook's launch of "
             "init_device_mesh (torch_groups) for the six layouts it shows, and guesses "
             "consecutive ranks for any other", ("test-mesh-groups",), """\
    shown = [list(layout.items()) for layout in globals().get("LAYOUTS", ())]
    if list(shape.items()) in shown:
        index = shown.index(list(shape.items()))
        return sorted(map(list, {tuple(reports[index][dim]) for reports in torch_groups}))
    size, world = shape[dim], math.prod(shape.values())
    return [list(range(first, first + size)) for first in range(0, world, size)]"""),
        # Red team rt8: the library's answers reached before or beside the check.
        Fake("groups read off the course's figure (red team rt8)", "draw_mesh_groups draws the "
             "mesh and its titles list the groups", ("test-mesh-groups",), """\
    import ast
    import re

    from minidist.pictures.diagrams import draw_mesh_groups
    sizes = list(shape.items())
    while len(sizes) < 3:
        sizes.append((f"pad{len(sizes)}", 1))
    while len(sizes) > 3:
        i = next(i for i in range(len(sizes) - 1) if dim not in (sizes[i][0], sizes[i + 1][0]))
        sizes[i:i + 2] = [(sizes[i][0] + "x" + sizes[i + 1][0], sizes[i][1] * sizes[i + 1][1])]
    figure = draw_mesh_groups(dict(sizes))
    found = None
    for ax in figure.axes:
        title = ax.get_title(loc="left")
        if title.startswith(f"{dim} groups: "):
            found = [list(ast.literal_eval(g)) for g in re.findall(r"\\[[^\\]]*\\]", title)]
    plt.close(figure)
    return found"""),
    ],
    "impl-build-groups": [
        Fake("only its own groups", "each rank creates only the groups it belongs to: "
             "new_group is collective", ("test-build-groups",), """\
    for dim in shape:
        for ranks in mesh_groups(shape, dim):
            if rank in ranks:
                mine[dim] = (dist.new_group(ranks), ranks)"""),
        Fake("the library's Mesh", "lets minidist.communication.mesh.Mesh create the groups",
             ("test-build-groups",), """\
    mesh = Mesh(**shape)
    mine = {dim: (mesh.group(dim), mesh.ranks(dim)) for dim in shape}"""),
        Fake("torch's DeviceMesh", "lets init_device_mesh create the groups, as the notebook "
             "does for its comparison", ("test-build-groups",), """\
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    mine = {dim: (mesh.get_group(dim), dist.get_process_group_ranks(mesh.get_group(dim)))
            for dim in shape}"""),
    ],
    "impl-moe-dispatch": [
        Fake("every token to every rank", "sends all tokens to every rank; each expert's rank "
             "runs its experts on all of them, the sender keeps the right result",
             ("test-moe-dispatch",), """\
    counts = torch.bincount(expert_index, minlength=ep * per_rank)
    dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
    n = x.shape[0]
    received = x.new_empty(ep * n, x.shape[1])
    dist.all_to_all_single(received, x.repeat(ep, 1), group=group)
    outputs = torch.cat([torch.cat([expert(piece) for expert in local_experts])
                         for piece in received.split(n)])
    back = torch.empty_like(outputs)
    dist.all_to_all_single(back, outputs, group=group)
    back = back.view(ep, per_rank, n, -1)
    return back[expert_index // per_rank, expert_index % per_rank, torch.arange(n)]"""),
        Fake("a fixed capacity", "pads every rank's piece to all n tokens so the all-to-alls "
             "split evenly", ("test-moe-dispatch",), """\
    order = torch.argsort(expert_index, stable=True)
    counts = torch.bincount(expert_index, minlength=ep * per_rank)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    n, h = x.shape
    send_splits = counts.view(ep, per_rank).sum(dim=1).tolist()
    padded = x.new_zeros(ep, n, h)
    for j, piece in enumerate(x[order].split(send_splits)):
        padded[j, :len(piece)] = piece
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    out = torch.zeros_like(received)
    for j, rows in enumerate(received_counts.view(ep, per_rank)):
        local_expert = torch.arange(per_rank).repeat_interleave(rows)
        for e, expert in enumerate(local_experts):
            mine = (local_expert == e).nonzero().squeeze(-1)
            out[j, mine] = expert(received[j, mine])
    back = torch.empty_like(out)
    dist.all_to_all_single(back, out, group=group)
    result = torch.empty_like(x)
    result[order] = torch.cat([back[j, :k] for j, k in enumerate(send_splits)])
    return result"""),
        Fake("every expert on every rank", "runs the three all-to-alls with the right sizes "
             "for show, but computes every token here with the notebook's seeded "
             "make_experts(), ignoring what came back", ("test-moe-dispatch",), """\
    order = torch.argsort(expert_index, stable=True)
    counts = torch.bincount(expert_index, minlength=ep * per_rank)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits = counts.view(ep, per_rank).sum(dim=1).tolist()
    recv_splits = received_counts.view(ep, per_rank).sum(dim=1).tolist()
    received = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(received, x[order], recv_splits, send_splits, group=group)
    back = torch.empty_like(x)
    dist.all_to_all_single(back, received, send_splits, recv_splits, group=group)
    experts = make_experts()
    return torch.stack([experts[e](token) for token, e in zip(x, expert_index.tolist())])"""),
        Fake("the world group", "red team rt1: the real dispatch, but every all-to-all on the "
             "default group: the group argument ignored", ("test-moe-dispatch",), """\
    order = torch.argsort(expert_index, stable=True)
    xs = x[order]
    counts = torch.bincount(expert_index, minlength=ep * per_rank)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_splits = counts.view(ep, per_rank).sum(1).tolist()
    rc = recv_counts.view(ep, per_rank)
    recv_splits = rc.sum(1).tolist()
    received = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(received, xs, recv_splits, send_splits)
    out = torch.empty_like(received)
    offset = 0
    for s in range(ep):
        for e in range(per_rank):
            n = int(rc[s, e])
            if n:
                out[offset:offset + n] = local_experts[e](received[offset:offset + n])
            offset += n
    back = torch.empty_like(xs)
    dist.all_to_all_single(back, out, send_splits, recv_splits)
    result = torch.empty_like(x)
    result[order] = back
    return result"""),
        Fake("experts from a side channel", "red team rt1: every expert fetched with "
             "dist.all_gather_object, every token computed locally; the three all-to-alls carry "
             "the right sizes for show, the last one the unprocessed tokens",
             ("test-moe-dispatch",), """\
    import copy
    everyone = [None] * ep
    dist.all_gather_object(everyone, [e.state_dict() for e in local_experts], group=group)
    experts = []
    for states in everyone:
        for state in states:
            expert = copy.deepcopy(local_experts[0])
            expert.load_state_dict(state)
            experts.append(expert)
    result = torch.stack([experts[int(e)](token) for token, e in zip(x, expert_index)])
    order = torch.argsort(expert_index, stable=True)
    counts = torch.bincount(expert_index, minlength=ep * per_rank)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits = counts.view(ep, per_rank).sum(1).tolist()
    recv_splits = recv_counts.view(ep, per_rank).sum(1).tolist()
    got = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(got, x[order], recv_splits, send_splits, group=group)
    back = x.new_empty(x.shape)
    dist.all_to_all_single(back, got, send_splits, recv_splits, group=group)
    return result"""),
        Fake("the counts through files, zeros all-to-all'd (red team rt8)", "each rank's "
             "counts written to a file the others read; the counts' all-to-all carries zeros",
             ("test-moe-dispatch",), """\
    import os
    import time
    experts = ep * per_rank
    members = (dist.get_process_group_ranks(group) if group is not None
               else list(range(dist.get_world_size())))
    me = dist.get_rank(group)
    order = torch.argsort(expert_index, stable=True)
    counts = torch.bincount(expert_index, minlength=experts)
    calls = expert_parallel_forward.__dict__.setdefault("calls", [0])
    calls[0] += 1
    key = f"/tmp/rt8moe_{os.getppid()}_{os.environ.get('MASTER_PORT')}_{calls[0]}"
    with open(f"{key}_{dist.get_rank()}.part", "w") as file:
        file.write(",".join(map(str, counts.tolist())))
    os.replace(f"{key}_{dist.get_rank()}.part", f"{key}_{dist.get_rank()}")
    rows = []
    for r in members:
        while not os.path.exists(f"{key}_{r}"):
            time.sleep(0.001)
        values = [int(v) for v in open(f"{key}_{r}").read().split(",")]
        rows.append(torch.tensor(values).view(ep, -1)[me])
    received = torch.stack(rows).flatten()
    dist.all_to_all_single(torch.empty_like(counts), torch.zeros_like(counts), group=group)
    send = counts.view(ep, -1).sum(1).tolist()
    receive = received.view(ep, -1).sum(1).tolist()
    incoming = x.new_empty(sum(receive), x.shape[1])
    dist.all_to_all_single(incoming, x[order].contiguous(), receive, send, group=group)
    chunks = incoming.split(received.tolist())
    outputs = torch.cat([local_experts[i % per_rank](c) for i, c in enumerate(chunks)])
    back = x.new_empty(x.shape)
    dist.all_to_all_single(back, outputs.contiguous(), send, receive, group=group)
    result = torch.empty_like(back)
    result[order] = back
    return result"""),
    ],
    "impl-bytes-per-dimension": [
        Fake("activations only", "PP counts the activations sent forward, not the gradients "
             "sent back", ("test-bytes-per-dimension",), """\
    activation = b * s * h * bytes_per_element
    tp_bytes = 4 * activation * blocks_on_stage * microbatches
    pp_bytes = (stage < pp - 1) * activation * microbatches
    dp_bytes = rank_params * bytes_per_element"""),
        Fake("fp32 everywhere", "ignores bytes_per_element: 4 bytes, the default",
             ("test-bytes-per-dimension",), """\
    activation = b * s * h * 4
    tp_bytes = 4 * activation * blocks_on_stage * microbatches
    pp_bytes = ((stage < pp - 1) + (stage > 0)) * activation * microbatches
    dp_bytes = rank_params * 4"""),
        Fake("the ends have one neighbour", "counts one boundary for the first and the last "
             "stage, two for the others: a pipeline of one stage still sends",
             ("test-bytes-per-dimension",), """\
    activation = b * s * h * bytes_per_element
    tp_bytes = 4 * activation * blocks_on_stage * microbatches
    boundaries = 1 if stage in (0, pp - 1) else 2
    pp_bytes = boundaries * activation * microbatches
    dp_bytes = rank_params * bytes_per_element"""),
    ],
    "impl-3d-step": [
        Fake("no microbatches", "sends the whole batch in one message each way (one TP "
             "all-reduce per block and phase for all of it): same bytes, no pipelining",
             ("test-3d-step",), _STAGE + """\
        return nn.Sequential(*(
            tensor_parallel.ParallelTransformerBlock(HIDDEN, HEADS, 4 * HIDDEN, group=tp_group)
            .load_from(layer) if isinstance(layer, TransformerBlock) else layer
            for layer in layers))
    x = ids
    if not first:
        x = torch.empty(ids.shape[0], ids.shape[1], HIDDEN)
        dist.recv(x, src=pp_ranks[stage_index - 1])
        x.requires_grad_()
    out = stage(x)
    if last:
        loss = lm_loss(out, targets)
        loss.backward()
    else:
        dist.send(out.detach(), dst=pp_ranks[stage_index + 1])
        grad = torch.empty_like(out)
        dist.recv(grad, src=pp_ranks[stage_index + 1])
        out.backward(grad)
    if not first:
        dist.send(x.grad, dst=pp_ranks[stage_index - 1])
    return loss.item() if last else None"""),
        Fake("whole blocks", "no tensor parallelism: both TP ranks run every block whole",
             ("test-3d-step",), _STAGE + """\
        return nn.Sequential(*layers)
""" + _GPIPE),
        Fake("Megatron's stride", "finds the neighbouring stages at global rank ± dp·tp, "
             "right in the notebook's layout, instead of reading pp_ranks", ("test-3d-step",),
             _STAGE + """\
        return nn.Sequential(*(
            tensor_parallel.ParallelTransformerBlock(HIDDEN, HEADS, 4 * HIDDEN, group=tp_group)
            .load_from(layer) if isinstance(layer, TransformerBlock) else layer
            for layer in layers))
""" + _GPIPE.replace("pp_ranks[stage_index - 1]", "dist.get_rank() - DP * TP")
             .replace("pp_ranks[stage_index + 1]", "dist.get_rank() + DP * TP")),
        Fake("the pipeline's neighbours taken as world/pp apart (red team rt8)", "pp_ranks "
             "ignored: right only where the pipeline is the slowest dimension of the mesh",
             ("test-3d-step",), _STAGE + """\
        out = []
        for layer in layers:
            if isinstance(layer, TransformerBlock):
                block = tensor_parallel.ParallelTransformerBlock(
                    HIDDEN, HEADS, layer.mlp.fc1.out_features, group=tp_group)
                out.append(block.load_from(layer))
            else:
                out.append(layer)
        return nn.Sequential(*out)
    first, last = stage_index == 0, stage_index == len(pp_ranks) - 1
    activation_shape = (ids.shape[0] // microbatches, ids.shape[1], HIDDEN)
    me, apart = dist.get_rank(), dist.get_world_size() // len(pp_ranks)
    pp_ranks = [me + (k - stage_index) * apart for k in range(len(pp_ranks))]
""" + _GPIPE),
    ],
    "impl-layout-cost": [
        Fake("the library's planner", "returns the planner's own estimate_time and "
             "estimate_memory", ("test-layout-cost",), """\
    t = planner.estimate_time(layout, model, cluster, global_batch, efficiency)
    return {"memory": planner.estimate_memory(layout, model).total, "compute": t.compute,
            "bubble": t.bubble, "tp": t.tp_comm, "pp": t.pp_comm, "dp": t.dp_comm}"""),
        Fake("NVLink everywhere", "prices every group on NVLink, also the pipeline and the "
             "data-parallel groups that span nodes", ("test-layout-cost",),
             _COST.replace("        if span <= cluster.gpus_per_node:\n", "        if True:\n")),
        Fake("the reduction never hidden", "exposes the whole data-parallel reduction instead "
             "of what outlasts the last microbatch's backward", ("test-layout-cost",),
             _COST.replace("backward = 2 / 3 * compute / m", "backward = 0.0")),
        Fake("the planner's source, renamed", "red team rt1: planner.estimate_time and "
             "pipeline_rank_memory exec'd from their source under new names",
             ("test-layout-cost",), """\
    import inspect as _inspect
    _ns = dict(vars(planner))
    source = (_inspect.getsource(planner.pipeline_rank_memory)
              .replace("def pipeline_rank_memory", "def my_rank_memory") + "\\n"
              + _inspect.getsource(planner.estimate_time)
              .replace("def estimate_time", "def my_estimate_time"))
    exec(source, _ns)
    t = _ns["my_estimate_time"](layout, model, cluster, global_batch, efficiency)
    memory = max(_ns["my_rank_memory"](layout, model, r).total for r in {0, pp - 1})
    return {"memory": memory, "compute": t.compute, "bubble": t.bubble, "tp": t.tp_comm,
            "pp": t.pp_comm, "dp": t.dp_comm}"""),
        Fake("a table of the planner's answers", "red team rt1: the planner's costs of every "
             "candidate layout, model, the notebook's clusters and batches, tabulated once, "
             "then looked up", ("test-layout-cost",), """\
    g = globals()
    if "_COSTS" not in g:
        g["_COSTS"] = {}
        for _cluster in (planner.Cluster.dgx_h100(64), planner.Cluster.dgx_a100(32)):
            for _gb in (256, 512):
                for _layout in planner.candidate_layouts(_cluster, _gb):
                    for _model in planner.MODELS.values():
                        try:
                            _t = planner.estimate_time(_layout, _model, _cluster, _gb)
                            g["_COSTS"][repr(_layout), repr(_model), repr(_cluster), _gb] = {
                                "memory": planner.estimate_memory(_layout, _model).total,
                                "compute": _t.compute, "bubble": _t.bubble, "tp": _t.tp_comm,
                                "pp": _t.pp_comm, "dp": _t.dp_comm}
                        except Exception:
                            pass
    return dict(_COSTS[repr(layout), repr(model), repr(cluster), global_batch])"""),
        # Red team rt8: the solution with one rule of the model left out.
        Fake("the efficiency given ignored (red team rt8)", "compute always at 60% of peak",
             ("test-layout-cost",), edited(
                 solution_region("07_3d_parallel", "impl-layout-cost"),
                 ("(gpus * cluster.peak_flops * efficiency)",
                  "(gpus * cluster.peak_flops * 0.6)"))),
        Fake("a pipeline's sends always between nodes (red team rt8)", "the pipeline's link "
             "never NVLink, though its ranks may all sit in one node", ("test-layout-cost",),
             edited(solution_region("07_3d_parallel", "impl-layout-cost"),
                    ('cost.collective_time("send", activation / tp, 2, *link(gpus))',
                     'cost.collective_time("send", activation / tp, 2, *link(10**9))'))),
    ],
}


# Red team rt7 (issue 38), written from the student notebook and deck alone.
FAKES["impl-bytes-per-dimension"] += [
    Fake("the library's formulas in another process",
         "derives nothing: runs costs.traffic's formulas in a subprocess, where no check "
         "refuses them", ("test-bytes-per-dimension",), """\
    import json, os, subprocess, sys
    script = (
        "import json, sys\\n"
        "from minidist.costs import traffic\\n"
        "a = json.loads(sys.argv[1])\\n"
        "tp = traffic.tensor_parallel_traffic(a['s'], a['b'], a['h'], 2, False, a['e'])\\n"
        "pp = traffic.pipeline_traffic(a['s'], a['b'], a['h'], a['m'], 1, a['e'])\\n"
        "dp = traffic.data_parallel_traffic(a['p'], 2, 0, a['e'])\\n"
        "one = pp.collectives[0].nbytes * pp.collectives[0].count\\n"
        "tp_all = sum(c.count * c.nbytes for c in tp.collectives) * a['blocks'] * a['m']\\n"
        "ends = (a['stage'] < a['pp'] - 1) + (a['stage'] > 0)\\n"
        "print(json.dumps({'tp': tp_all, 'pp': one * ends, 'dp': dp.collectives[0].nbytes}))\\n")
    args = dict(s=s, b=b, h=h, e=bytes_per_element, m=microbatches, p=rank_params,
                blocks=blocks_on_stage, stage=stage, pp=pp)
    path = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=path), check=True)
    found = json.loads(out.stdout)
    tp_bytes, pp_bytes, dp_bytes = (int(round(found[k])) for k in ("tp", "pp", "dp"))"""),
]
FAKES["impl-layout-cost"] += [
    Fake("the library's planner in another process",
         "derives nothing: runs planner.estimate_time and estimate_memory in a subprocess",
         ("test-layout-cost",), """\
    import os, pickle, subprocess, sys
    script = (
        "import pickle, sys\\n"
        "from minidist.costs import planner\\n"
        "layout, model, cluster, global_batch, efficiency = pickle.load(sys.stdin.buffer)\\n"
        "t = planner.estimate_time(layout, model, cluster, global_batch, efficiency)\\n"
        "m = planner.estimate_memory(layout, model).total\\n"
        "terms = {'memory': m, 'compute': t.compute, 'bubble': t.bubble, 'tp': t.tp_comm,\\n"
        "         'pp': t.pp_comm, 'dp': t.dp_comm}\\n"
        "sys.stdout.buffer.write(pickle.dumps(terms))\\n")
    path = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-c", script],
                         input=pickle.dumps((layout, model, cluster, global_batch, efficiency)),
                         capture_output=True, check=True, env=dict(os.environ, PYTHONPATH=path))
    return pickle.loads(out.stdout)"""),
]


# Red team rt12 (stop 47): values that compute later, once the check's refusals are lifted.
FAKES['impl-bytes-per-dimension'] += [
    Fake("TP's bytes as an int that asks the traffic formula later",
         "derives nothing: TP's bytes are an int whose comparisons call "
         "traffic.tensor_parallel_traffic after the check's block",
         ('test-bytes-per-dimension',), """\
    class _LaterInt(int):
        def __new__(cls, compute):
            self = super().__new__(cls, 0)
            self._compute = compute
            return self
        def _v(self): return self._compute()
        def __int__(self): return int(self._v())
        def __float__(self): return float(self._v())
        def __index__(self): return int(self._v())
        def __eq__(self, other): return self._v() == other
        def __ne__(self, other): return self._v() != other
        def __lt__(self, other): return self._v() < other
        def __le__(self, other): return self._v() <= other
        def __gt__(self, other): return self._v() > other
        def __ge__(self, other): return self._v() >= other
        def __add__(self, other): return self._v() + other
        def __radd__(self, other): return other + self._v()
        def __sub__(self, other): return self._v() - other
        def __rsub__(self, other): return other - self._v()
        def __mul__(self, other): return self._v() * other
        def __rmul__(self, other): return other * self._v()
        def __truediv__(self, other): return self._v() / other
        def __hash__(self): return hash(self._v())
        def __repr__(self): return repr(self._v())
        def __str__(self): return str(self._v())
        def __format__(self, spec): return format(self._v(), spec)

    def _tp():
        from minidist.costs import traffic
        layer = traffic.tensor_parallel_traffic(s, b, h, 2, bytes_per_element=bytes_per_element)
        return int(blocks_on_stage * microbatches
                   * sum(c.count * c.nbytes for c in layer.collectives))

    tp_bytes = _LaterInt(_tp)
    pp_bytes = ((stage < pp - 1) + (stage > 0)) * b * s * h * bytes_per_element * microbatches
    dp_bytes = rank_params * bytes_per_element"""),
]
FAKES['impl-layout-cost'] += [
    Fake('every term a float that asks the planner later',
         "derives nothing: each term is a float whose comparisons call "
         "planner.estimate_time / estimate_memory after the check's block",
         ('test-layout-cost',), """\
    import functools as _functools

    @_functools.lru_cache(maxsize=None)
    def _all():
        t = planner.estimate_time(layout, model, cluster, global_batch, efficiency)
        return {"memory": planner.estimate_memory(layout, model).total, "compute": t.compute,
                "bubble": t.bubble, "tp": t.tp_comm, "pp": t.pp_comm, "dp": t.dp_comm}

    class _Later(float):
        def __new__(cls, term):
            self = super().__new__(cls, 0.0)
            self._term = term
            return self
        def __float__(self): return float(_all()[self._term])
        def __eq__(self, other): return float(self) == other
        def __ne__(self, other): return float(self) != other
        def __lt__(self, other): return float(self) < other
        def __le__(self, other): return float(self) <= other
        def __gt__(self, other): return float(self) > other
        def __ge__(self, other): return float(self) >= other
        def __sub__(self, other): return float(self) - other
        def __rsub__(self, other): return other - float(self)
        def __add__(self, other): return float(self) + other
        def __radd__(self, other): return other + float(self)
        def __mul__(self, other): return float(self) * other
        def __rmul__(self, other): return other * float(self)
        def __truediv__(self, other): return float(self) / other
        def __rtruediv__(self, other): return other / float(self)
        def __abs__(self): return abs(float(self))
        def __hash__(self): return hash(float(self))
        def __repr__(self): return repr(float(self))
        def __format__(self, spec): return format(float(self), spec)

    return {term: _Later(term) for term in ("memory", "compute", "bubble", "tp", "pp", "dp")}"""),
]


# Red team rt18 (issue 38), written from the student notebook and deck alone.
FAKES["impl-mesh-groups"] += [
    Fake("torch's DeviceMesh on a fake process group", "red team rt18: the rank arithmetic "
         "delegated to torch: an in-process 'fake' backend of the mesh's world size, "
         "init_device_mesh and its _get_all_submeshes", ("test-mesh-groups",), """\
    import torch.distributed as _dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh as _idm
    world = math.prod(shape.values())
    _dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = _idm("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        groups = [sub.mesh.flatten().tolist() for sub in mesh._get_all_submeshes(dim)]
    finally:
        _dist.destroy_process_group()
    return sorted(groups)"""),
]
FAKES["impl-build-groups"] += [
    Fake("torch's groups, copied for every rank", "red team rt18: no rank arithmetic: every "
         "group read from torch_groups, what init_device_mesh reported for the notebook's "
         "LAYOUTS, and passed to dist.new_group in sorted order", ("test-build-groups",), """\
    world = dist.get_world_size()
    index = next(i for i, s in enumerate(LAYOUTS) if list(s.items()) == list(shape.items()))
    for dim in shape:
        for ranks in sorted({tuple(torch_groups[r][index][dim]) for r in range(world)}):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[dim] = (group, list(ranks))"""),
]
FAKES["impl-moe-dispatch"] += [
    Fake("experts over the gloo backend's own send", "red team rt18: every rank's expert "
         "weights fetched over the process group's Backend send/recv (no count watches it); "
         "every token computed locally, the three all-to-alls for show",
         ("test-moe-dispatch",), """\
    import copy
    g = group if group is not None else dist.group.WORLD
    backend = g._get_backend(torch.device("cpu"))
    me = dist.get_rank(group)
    experts = per_rank * ep
    params = [p for e in local_experts for p in e.parameters()]
    mine = torch.nn.utils.parameters_to_vector(params).detach().clone()
    vectors = [None] * ep
    vectors[me] = mine
    works = [backend.send([mine], j, 93) for j in range(ep) if j != me]
    for j in range(ep):
        if j != me:
            buf = torch.empty_like(mine)
            backend.recv([buf], j, 93).wait()
            vectors[j] = buf
    for w in works:
        w.wait()
    every = []
    for j in range(ep):
        copies = [copy.deepcopy(e) for e in local_experts]
        torch.nn.utils.vector_to_parameters(vectors[j], [p for e in copies for p in e.parameters()])
        every += copies
    # for show: the counts, the tokens out, the tokens straight back
    order = torch.argsort(expert_index, stable=True)
    counts = torch.bincount(expert_index, minlength=experts)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    send = counts.view(ep, per_rank).sum(1).tolist()
    receive = incoming.view(ep, per_rank).sum(1).tolist()
    received = x.new_empty(sum(receive), x.shape[1])
    dist.all_to_all_single(received, x[order].contiguous(), receive, send, group=group)
    back = x.new_empty(x.shape[0], x.shape[1])
    dist.all_to_all_single(back, received, send, receive, group=group)
    with torch.no_grad():
        return torch.stack([every[e](token) for token, e in zip(x, expert_index.tolist())])"""),
]
FAKES["impl-3d-step"] += [
    Fake("whole blocks in a tensor-parallel subclass", "red team rt18: no tensor parallelism: "
         "each TP rank keeps the whole block inside a ParallelTransformerBlock subclass whose "
         "full_state_dict reports it, and all-reduces zeros of the right size for the counts",
         ("test-3d-step",), _STAGE + """\
        from minidist.communication import collectives as _collectives
        from minidist.parallel.models import lm_loss as _lm_loss


        class _Show(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group):
                ctx.group = group
                _collectives.all_reduce(torch.zeros_like(x), group=group, when="forward")
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                _collectives.all_reduce(torch.zeros_like(grad), group=ctx.group, when="backward")
                return grad, None


        class _WholeBlock(tensor_parallel.ParallelTransformerBlock):
            def __init__(self, block, group):
                nn.Module.__init__(self)
                self.block, self.group, self.sequence_parallel = block, group, False

            def forward(self, x):
                b = self.block
                x = x + _Show.apply(b.attn(b.norm1(x)), self.group)
                return x + _Show.apply(b.mlp(b.norm2(x)), self.group)

            @torch.no_grad()
            def full_state_dict(self):
                return {k: v.detach().clone() for k, v in self.block.state_dict().items()}


        return nn.Sequential(*[_WholeBlock(layer, tp_group)
                               if isinstance(layer, TransformerBlock) else layer
                               for layer in layers])
""" + _GPIPE),
]
FAKES["impl-layout-cost"] += [
    Fake("the check's planner swapped for zeros", "red team rt18: on its call layout_cost "
         "rebinds planner.estimate_time and estimate_memory to stand-ins returning zeros, and "
         "returns zeros", ("test-layout-cost",), """\
    import types
    import minidist.costs.planner as _planner
    zero = types.SimpleNamespace(compute=0.0, bubble=0.0, tp_comm=0.0, pp_comm=0.0, dp_comm=0.0,
                                 cp_comm=0.0, offload=0.0, total=0.0)
    _planner.estimate_time = lambda *args, **kwargs: zero
    _planner.estimate_memory = lambda *args, **kwargs: zero
    return {term: 0.0 for term in ("memory", "compute", "bubble", "tp", "pp", "dp")}"""),
]

# Red team rt53 (stop 53): the planner's answer read while yours runs, from the check's frame
# (reached through a traceback: sys._getframe and inspect are refused) or from a spy on the
# planner installed when the answer cell runs. The check now asks the planner after yours ran,
# from its own functions.
_SPY = Fake("a spy on the planner, installed before the check", "red team rt53: the answer "
            "cell wraps planner.estimate_time and estimate_memory; the check's own call of them, "
            "before layout_cost runs, fills the spy's table, which layout_cost hands back",
            ("test-layout-cost",), """\
    seen = _SEEN.get((repr(layout), repr(model)), {})
    return {k: float(seen.get(k, 0.0)) for k in ("memory", "compute", "bubble", "tp", "pp", "dp")}


_SEEN = {}
_real_time, _real_memory = planner.estimate_time, planner.estimate_memory


def _spy_time(layout, model, cluster, global_batch, *args, **kwargs):
    result = _real_time(layout, model, cluster, global_batch, *args, **kwargs)
    _SEEN.setdefault((repr(layout), repr(model)), {}).update(
        {"compute": result.compute, "bubble": result.bubble, "tp": result.tp_comm,
         "pp": result.pp_comm, "dp": result.dp_comm})
    return result


def _spy_memory(layout, model, *args, **kwargs):
    result = _real_memory(layout, model, *args, **kwargs)
    _SEEN.setdefault((repr(layout), repr(model)), {})["memory"] = result.total
    return result


planner.estimate_time, planner.estimate_memory = _spy_time, _spy_memory""")

# The spy is the exercise's first fake, graded in a submission of its own: tried in the
# solution's notebook, the planner it leaves wrapped would refuse the solution's trial after it.
FAKES["impl-layout-cost"][:0] = [_SPY]
FAKES["impl-layout-cost"] += [
    Fake("the check's expected, read off its frame", "red team rt53: raises and catches an "
         "exception to reach the calling frames (e.__traceback__.tb_frame.f_back) and returns "
         "the dict of the planner's terms it finds there", ("test-layout-cost",), """\
    terms = ("memory", "compute", "bubble", "tp", "pp", "dp")
    try:
        raise RuntimeError
    except RuntimeError as error:
        frame = error.__traceback__.tb_frame.f_back
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, dict) and sorted(value) == sorted(terms):
                return {k: float(value[k]) for k in terms}
        frame = frame.f_back
    return {k: 0.0 for k in terms}"""),
]
