"""Fakes of Lab 02's exercises: the right numbers without measuring storages or saved tensors,
without recomputing, without the overlap or the latency, or from the library (or torch).

A cell with two solution regions (the Function's forward and backward; the two functions of
the overlap exercise) gets a tuple: one source per region."""

from fakes import PRESTARTED_PROCESS, PRESTARTED_THREAD, Alternative, Fake

# The backward of the fakes that keep forward's graph in ctx.stash: it runs the module once,
# without autograd, for the check's counter to see, then backpropagates through the kept graph.
# Recompute's forward and backward without the random state: x kept, the module rerun.
_KEEP_ONLY_X = """\
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return module(x)"""
_RERUN = """\
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.module(x)
        torch.autograd.backward(out, grad_output)
        return x.grad, None"""

_BACKWARD_FROM_STASH = """\
        (x,) = ctx.saved_tensors
        inner, out = ctx.stash
        with torch.no_grad():
            ctx.module(x)
        torch.autograd.backward(out, grad_output)
        return inner.grad, None"""



# The rt15 held_bytes fakes' shared helper: bytes of the distinct storages among `tensors`.
_STORAGE_BYTES = '''\
    def _storage_bytes(tensors):
        seen = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

'''

FAKES = {
    "impl-held-bytes": [
        Fake("the library's footprint, cloned into a pre-started thread", "a code-clone of "
             "footprint.model_state_footprint, made and run in a thread started when the "
             "answer cell ran", ("test-held-bytes",), """\
    state = _elsewhere(_fp["model_state_footprint"], model, optimizer)
    return (int(state.params), int(state.grads), int(state.optimizer))""" + PRESTARTED_THREAD + """

import minidist.costs.footprint as _footprint
_fp = _clone_module(_footprint)"""),
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
        Fake("the library's footprint",
             "delegates to minidist.costs.footprint.model_state_footprint",
             ("test-held-bytes",), """\
    held = footprint.model_state_footprint(model, optimizer)
    return held.params, held.grads, held.optimizer"""),
        Fake("the optimizer's bytes from a formula", "measures params and grads but gives the "
             "optimizer's state from a per-type formula (Adam: two fp32 moments and a step), never "
             "reading optimizer.state",
             ("test-held-bytes",), """\
    def distinct(tensors):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    mine = {p.untyped_storage().data_ptr() for p in params}
    updated = [p for g in optimizer.param_groups for p in g["params"]]
    masters = [p for p in updated if p.untyped_storage().data_ptr() not in mine]
    elements = sum(p.numel() for p in updated)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        state = 2 * 4 * elements + 4 * len(updated)
    elif isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum", 0):
        state = 4 * elements
    else:
        state = 0
    return (distinct(params), distinct(grads), state + distinct(masters))"""),
        Fake("the library's footprint, reloaded", "importlib.reload(footprint) makes a "
             "model_state_footprint the refusal does not hold, and returns its numbers",
             ("test-held-bytes",), """\
    import importlib
    from minidist.costs import footprint as _fp
    importlib.reload(_fp)
    state = _fp.model_state_footprint(model, optimizer)
    return (int(state.params), int(state.grads), int(state.optimizer))"""),
        Fake("the library's private helper, inlined", "model_state_footprint's body rewritten "
             "around footprint._storage, the library's private storage key",
             ("test-held-bytes",), """\
    key = footprint._storage
    def distinct(tensors):
        return sum(dict(key(t) for t in tensors).values())
    ps = list(model.parameters())
    gs = [p.grad for p in ps if p.grad is not None]
    own = {key(t)[0] for t in ps + gs}
    extra = [p for group in optimizer.param_groups for p in group["params"] if key(p)[0] not in own]
    st = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    extra_grads = [p.grad for p in extra if p.grad is not None]
    return distinct(ps), distinct(gs + extra_grads), distinct(extra + st)"""),
        # Red team rt15 (issue 38).
        Fake("optimizer tensors by their own size", "dedupes the parameters' and gradients' "
             "storages but sums the optimizer's tensors by numel x element size: moments laid "
             "out in one flat buffer with spare room come out short", ("test-held-bytes",),
             _STORAGE_BYTES + """\
    params = list(model.parameters())
    mine = {id(p) for p in params}
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    extra = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    return (_storage_bytes(params), _storage_bytes([p.grad for p in params if p.grad is not None]),
            sum(t.numel() * t.element_size() for t in state + extra))"""),
        Fake("master copies by dtype", "takes the optimizer's tensors whose dtype differs from "
             "the model's first parameter for its master copies, not those that are not the "
             "model's", ("test-held-bytes",), _STORAGE_BYTES + """\
    params = list(model.parameters())
    model_dtype = params[0].dtype if params else torch.float32
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    extra = [p for g in optimizer.param_groups for p in g["params"] if p.dtype != model_dtype]
    return (_storage_bytes(params), _storage_bytes([p.grad for p in params if p.grad is not None]),
            _storage_bytes(state + extra))"""),
        Fake("gradients as the parameters' bytes", "reports the parameters' bytes for the "
             "gradients, whether or not each has one", ("test-held-bytes",), _STORAGE_BYTES + """\
    params = list(model.parameters())
    mine = {id(p) for p in params}
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    extra = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    p_bytes = _storage_bytes(params)
    return (p_bytes, p_bytes, _storage_bytes(state + extra))"""),
    ],
    "impl-saved-bytes": [
        Fake("the library's measurement, cloned into a pre-started thread", "a code-clone of "
             "footprint.saved_activations, made and run in a thread started when the answer "
             "cell ran (its hooks and the module's run happen there)", ("test-saved-bytes",),
             """\
    return int(sum(t.nbytes for t in _elsewhere(_fp2["saved_activations"], module, x)))"""
             + PRESTARTED_THREAD + """

import minidist.costs.footprint as _footprint
_fp2 = _clone_module(_footprint)"""),
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
        Fake("the library's measurement", "delegates to minidist.costs.footprint.saved_activations",
             ("test-saved-bytes",), """\
    return sum(t.nbytes for t in footprint.saved_activations(module, x))"""),
        Fake("the library's measurement, from a copy of its module", "loads "
             "minidist.costs.footprint again from its file and sums its saved_activations",
             ("test-saved-bytes",), """\
    import importlib.util, sys
    from minidist.costs import footprint as _fp
    spec = importlib.util.spec_from_file_location("_footprint_copy2", _fp.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy
    spec.loader.exec_module(copy)
    return int(sum(t.nbytes for t in copy.saved_activations(module, x)))"""),
        Fake("what the forward left allocated", "no saved_tensors_hooks: the bytes the forward "
             "allocated and left alive (the library's holding() profiler), less the output, plus x",
             ("test-saved-bytes",), """\
    from minidist.core.checking import holding
    with holding() as held:
        out = module(x)
    return int(held.nbytes - out.untyped_storage().nbytes() + x.untyped_storage().nbytes())"""),
        # Red team rt15 (issue 38).
        Fake("saved tensors' own bytes, by address", "the pack hook dedupes by the tensor's "
             "data_ptr and counts its numel x element size, not its storage's: views that cover "
             "part of a storage come out short", ("test-saved-bytes",), """\
    skip = {p.data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in skip:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())"""),
        Fake("the graph's saved attributes, no hooks", "runs module(x) without "
             "saved_tensors_hooks, then walks the output's grad_fn graph reading every node's "
             "_saved_* attributes, deduped by storage", ("test-saved-bytes",), """\
    out = module(x)
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, stack, visited = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except Exception:
                    continue
                for t in (value if isinstance(value, (tuple, list)) else [value]):
                    if isinstance(t, torch.Tensor):
                        s = t.untyped_storage()
                        if s.data_ptr() not in skip:
                            seen[s.data_ptr()] = s.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(seen.values())"""),
        Fake("the graph's saved attributes from every tensor made (red team rt8)", "a dispatch "
             "mode collects every op's output, the graph's _saved_ attributes are read from "
             "them; the hooks block is a decoy", ("test-saved-bytes",), """\
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor)]
            return out
    mode = Outputs()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), mode:
        module(x)
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, visited = {}, set()
    stack = [t.grad_fn for t in mode.made if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except Exception:
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    scalar = isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype in (
                        torch.float64, torch.int64)
                    if isinstance(t, torch.Tensor) and not scalar:
                        if t.untyped_storage().data_ptr() not in parameters:
                            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [fn for fn, _ in node.next_functions]
    return sum(seen.values())"""),
    ],
    "impl-recompute": [
        Fake("the whole graph, kept from a pre-started thread", "no recompute: forward builds "
             "and keeps the whole graph in a thread started when the answer cell ran (out of "
             "the pack hook's and the memory profiler's sight); backward reruns the module "
             "with autograd off, for show", ("test-recompute",), ("""\
        def build():
            # the module's own forward runs with autograd off (a counter of its runs sees it
            # unrecorded); its children switch autograd back on
            def grad_on(submodule, args):
                torch.set_grad_enabled(True)

            hooks = [child.register_forward_pre_hook(grad_on) for child in module.children()]
            try:
                with torch.no_grad():
                    xx = x.detach().requires_grad_(True)
                    out = module(xx)
            finally:
                for hook in hooks:
                    hook.remove()
            return xx, out

        ctx.save_for_backward(x)
        ctx.module = module
        ctx.xx, ctx.out = _elsewhere(build)
        return ctx.out.detach()""", """\
        x, = ctx.saved_tensors
        with torch.no_grad():
            ctx.module(x)  # the "recompute", for show
        ctx.out.backward(grad_output)  # through the graph kept since forward
        grad = ctx.xx.grad
        ctx.xx = ctx.out = None
        return grad, None""" + PRESTARTED_THREAD)),
        Fake("the whole graph, under the Function's own hooks", "no recompute: forward keeps "
             "the whole graph, built under its own saved_tensors_hooks (the innermost wins, so "
             "the check's pack hook never sees it); backward reruns the module for show",
             ("test-recompute",), ("""\
        ctx.save_for_backward(x)
        ctx.module = module

        def grad_on(submodule, args):
            torch.set_grad_enabled(True)

        hooks = [child.register_forward_pre_hook(grad_on) for child in module.children()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                xx = x.detach().requires_grad_(True)
                out = module(xx)
        finally:
            for hook in hooks:
                hook.remove()
            torch.set_grad_enabled(False)
        ctx.xx, ctx.out = xx, out
        return out.detach()""", """\
        x, = ctx.saved_tensors
        with torch.no_grad():
            ctx.module(x)  # the "recompute", for show
        with torch.enable_grad():
            ctx.out.backward(grad_output)
        grad = ctx.xx.grad
        ctx.xx = ctx.out = None
        return grad, None""")),
        Fake("torch's checkpoint inside", "recomputes nothing itself: wraps "
             "torch.utils.checkpoint.checkpoint in the Function", ("test-recompute",), (
                 """\
        ctx.x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            ctx.out = torch.utils.checkpoint.checkpoint(module, ctx.x, use_reentrant=False)
        return ctx.out.detach()""", """\
        torch.autograd.backward(ctx.out, grad_output)
        return ctx.x.grad, None""")),
        Fake("the whole graph kept", "no recompute: forward runs the module with autograd on and "
             "keeps its graph for backward", ("test-recompute",), (
                 """\
        ctx.x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            ctx.out = module(ctx.x)
        return ctx.out.detach()""", """\
        torch.autograd.backward(ctx.out, grad_output)
        return ctx.x.grad, None""")),
        Fake("the input's gradient only", "reruns the module but takes only x's gradient "
             "(torch.autograd.grad): the parameters get no .grad", ("test-recompute",), (
                 _KEEP_ONLY_X, """\
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.module(x)
        (grad_x,) = torch.autograd.grad(out, x, grad_output)
        return grad_x, None""")),
        Fake("torch's private checkpoint generator", "wraps torch.utils.checkpoint's "
             "_checkpoint_without_reentrant_generator, which is not the refused checkpoint "
             "function, in the Function",
             ("test-recompute",), (
                 """\
        import torch.utils.checkpoint as _cp
        ctx.save_for_backward(x)
        inner = x.detach().requires_grad_(True)
        with torch.enable_grad():
            gen = _cp._checkpoint_without_reentrant_generator(
                module, True, _cp.noop_context_fn, _cp._DEFAULT_DETERMINISM_MODE, False, True,
                inner)
            next(gen)
            out = module(inner)
            next(gen, None)
        ctx.stash = (inner, out)
        return out.detach()""",
                 """\
        inner, out = ctx.stash
        torch.autograd.backward(out, grad_output)
        return inner.grad, None""")),
        Fake('the graph kept under hooks of its own', "forward records the whole graph under "
             "identity saved_tensors_hooks of its own (the check's pack sees only x); backward "
             "reruns the module only to be counted",
             ("test-recompute",), (
                 """\
        ctx.module = module
        ctx.save_for_backward(x)
        inner = x.detach().requires_grad_(True)
        hidden = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with torch.enable_grad(), hidden:
            out = module(inner)
        ctx.stash = (inner, out)
        return out.detach()""",
                 _BACKWARD_FROM_STASH)),
        Fake('the graph kept, built past the counter', "as the one above, with the graph built "
             "on the module inside the check's counter, and the counted module run without "
             "autograd for show: no recompute, every tensor kept",
             ("test-recompute",), (
                 """\
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            module(x)
        body = getattr(module, "inner", module)
        inner = x.detach().requires_grad_(True)
        hidden = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with torch.enable_grad(), hidden:
            out = body(inner)
        ctx.stash = (inner, out)
        return out.detach()""",
                 _BACKWARD_FROM_STASH)),
        # Red team rt15 (issue 38).
        Fake("recompute without the random state", "a plain recompute that neither keeps nor "
             "restores the random state: with dropout the rerun draws another mask",
             ("test-recompute",), (_KEEP_ONLY_X, _RERUN)),
        Fake("a fixed seed for both runs", "reseeds torch.manual_seed(0) before forward and "
             "before the rerun instead of keeping and restoring the random state (the draws "
             "are not the caller's, and the global stream is clobbered)", ("test-recompute",), (
                 """\
        ctx.module = module
        ctx.save_for_backward(x)
        torch.manual_seed(0)
        with torch.no_grad():
            return module(x)""", """\
        x, = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        torch.manual_seed(0)
        with torch.enable_grad():
            out = ctx.module(x)
        torch.autograd.backward(out, grad_output)
        return x.grad, None""")),
        # Red team rt8: forward's random draws recorded by a dispatch mode, replayed in backward.
        Fake("random draws recorded and replayed, as Python lists (red team rt8)", "no random "
             "state: a dispatch mode keeps every random op's output off torch's books and hands "
             "it back in the rerun", ("test-recompute",), ("""\
        from torch.utils._python_dispatch import TorchDispatchMode

        class Record(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.tape = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ in ("native_dropout", "bernoulli", "bernoulli_",
                                                    "rand", "randn", "uniform_", "normal_"):
                    parts = out if isinstance(out, tuple) else (out,)
                    self.tape.append([(p.tolist(), p.dtype) for p in parts])
                return out
        ctx.module = module
        ctx.save_for_backward(x)
        recorder = Record()
        with torch.no_grad(), recorder:
            out = module(x)
        ctx.tape = recorder.tape
        return out""", """\
        from torch.utils._python_dispatch import TorchDispatchMode

        class Replay(TorchDispatchMode):
            def __init__(self, tape):
                super().__init__()
                self.tape = list(tape)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if self.tape and name in ("native_dropout", "bernoulli", "bernoulli_", "rand",
                                          "randn", "uniform_", "normal_"):
                    parts = [torch.tensor(v, dtype=dtype) for v, dtype in self.tape.pop(0)]
                    if name == "native_dropout":
                        mask = parts[1]
                        return args[0] * mask * (1.0 / (1.0 - args[1])), mask
                    return args[0].copy_(parts[0]) if name.endswith("_") else parts[0]
                return func(*args, **(kwargs or {}))
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), Replay(ctx.tape):
            out = ctx.module(x)
        torch.autograd.backward(out, grad_output)
        return x.grad, None""")),
    ],
    "impl-hiding": [
        Fake("the library's overlap, in a pre-started process", "cost.exposed_time and "
             "critical_intensity called in a process forked when the answer cell ran",
             ("test-hiding",), ("""\
    return float(_library("minidist.costs.cost", "exposed_time", flops, nbytes, peak_flops,
                          link))""", """\
    return float(_library("minidist.costs.cost", "critical_intensity", nbytes, peak_flops,
                          link))""" + PRESTARTED_PROCESS)),
        Fake("the library's overlap", "delegates to minidist.costs.cost.exposed_time and "
             "critical_intensity", ("test-hiding",), (
                 """\
    return cost.exposed_time(flops, nbytes, peak_flops, link)""", """\
    return cost.critical_intensity(nbytes, peak_flops, link)""")),
        Fake("no latency", "the transfer as bytes over bandwidth only: alpha left out of both",
             ("test-hiding",), (
                 """\
    return max(0.0, nbytes * link.beta - flops / peak_flops)""", """\
    return peak_flops * link.beta""")),
        Fake("time given back", "no max(0, ...): a transfer shorter than the compute comes out "
             "negative", ("test-hiding",), (
                 """\
    return link.alpha + nbytes * link.beta - flops / peak_flops""", """\
    return peak_flops * (link.alpha / nbytes + link.beta)""")),
        Fake("the library's overlap, in another process", "asks a fresh Python process, where "
             "nothing is refused, for exposed_time and critical_intensity",
             ("test-hiding",), (
                 """\
    import subprocess, sys
    code = ("from minidist.costs.cost import AlphaBeta, exposed_time; "
            f"print(repr(exposed_time({flops!r}, {nbytes!r}, {peak_flops!r}, "
            f"AlphaBeta({link.alpha!r}, {link.beta!r}))))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(ran.stdout)""",
                 """\
    import subprocess, sys
    code = ("from minidist.costs.cost import AlphaBeta, critical_intensity; "
            f"print(repr(critical_intensity({nbytes!r}, {peak_flops!r}, "
            f"AlphaBeta({link.alpha!r}, {link.beta!r}))))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(ran.stdout)""")),
        Fake("the library's overlap, reloaded", "importlib.reload(cost) makes exposed_time and "
             "critical_intensity the refusal does not hold",
             ("test-hiding",), (
                 """\
    import importlib
    from minidist.costs import cost as _c
    importlib.reload(_c)
    return float(_c.exposed_time(flops, nbytes, peak_flops, link))""",
                 """\
    import importlib
    from minidist.costs import cost as _c
    importlib.reload(_c)
    return float(_c.critical_intensity(nbytes, peak_flops, link))""")),
        Fake("the library's source, renamed", "cost.exposed_time and critical_intensity read "
             "with inspect.getsource, renamed, their docstrings stripped, compiled in a copy of "
             "cost's globals", ("test-hiding",), (
                 """\
    import ast, inspect
    tree = ast.parse(inspect.getsource(cost.exposed_time))
    tree.body[0].name, tree.body[0].body = "_exposed", tree.body[0].body[1:]
    namespace = dict(vars(cost))
    exec(compile(tree, "<my notes>", "exec"), namespace)
    return float(namespace["_exposed"](flops, nbytes, peak_flops, link))""", """\
    import ast, inspect
    tree = ast.parse(inspect.getsource(cost.critical_intensity))
    tree.body[0].name, tree.body[0].body = "_intensity", tree.body[0].body[1:]
    namespace = dict(vars(cost))
    exec(compile(tree, "<my notes>", "exec"), namespace)
    return float(namespace["_intensity"](nbytes, peak_flops, link))""")),
    ],
}


ALTERNATIVES = {
    "impl-recompute": [
        Alternative("the random state saved for backward", "keeps forward's random state with "
                    "ctx.save_for_backward, beside x, instead of as an attribute of ctx: the "
                    "spec asks that nothing the module computes be kept, and the random state "
                    "is not", ("test-recompute",), (
                        """\
        ctx.module = module
        ctx.save_for_backward(x, torch.get_rng_state())
        with torch.no_grad():
            return module(x)""", """\
        x, state = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(state)
            out = ctx.module(x)
        torch.autograd.backward(out, grad_output)
        return x.grad, None""")),
    ],
}

# --- Red team rt7 (issue 38): every storage counted once by torch's serialiser or by a copy the
# profiler measures; a recompute that keeps dropout's masks outside torch (numpy), one that
# switches dropout off for good, and one that keeps forward's whole graph in numpy and reruns a
# decoy; the message time from the library's algorithm table. The checks now refuse those
# helpers, draw noise that is not dropout's, check the module's mode, and change the weights
# between forward and backward.
# The three totals of held_bytes from a `total(tensors)` the fake defines above it.
_TOTALS = """\
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    ids = {id(p) for p in params}
    masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in ids]
    states = [v for st in optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor)]
    return total(params), total(grads), total(masters + states)"""
FAKES["impl-held-bytes"] += [
    Fake("torch.save counts the storages", "the sizes of the data entries of a torch.save into "
         "memory: one per storage, whole (red team rt7)", ("test-held-bytes",), """\
    import io
    import zipfile

    def total(tensors):
        buffer = io.BytesIO()
        torch.save([t.detach() for t in tensors], buffer)
        buffer.seek(0)
        with zipfile.ZipFile(buffer) as archive:
            return sum(info.file_size for info in archive.infolist()
                       if info.filename.split("/")[-2] == "data")

""" + _TOTALS),
    Fake("a deep copy, measured", "deepcopy copies each storage once; the library's holding() "
         "says what the copy allocated (red team rt7)", ("test-held-bytes",), """\
    import copy

    from minidist.core.checking import holding

    def total(tensors):
        tensors = [t.detach() for t in tensors]
        with holding() as held:
            clone = copy.deepcopy(tensors)
        del clone
        return int(held.new_bytes())

""" + _TOTALS),
]
FAKES["impl-recompute"] += [
    Fake("dropout's masks kept in numpy", "forward records each dropout mask outside torch's "
         "allocator, backward replays them: no random state, and only F.dropout's draws (red team "
         "rt7)", ("test-recompute",), ("""\
        import torch.nn.functional as F

        real, ctx.module, ctx.masks = F.dropout, module, []

        def recording(input, p=0.5, training=True, inplace=False):
            if not training or p == 0:
                return input
            noise = torch.empty_like(input).bernoulli_(1 - p)
            ctx.masks.append(noise.numpy().astype(bool))
            return input * noise.div_(1 - p)

        ctx.save_for_backward(x)
        F.dropout = recording
        try:
            with torch.no_grad():
                return module(x)
        finally:
            F.dropout = real""", """\
        import torch.nn.functional as F

        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        real, masks = F.dropout, list(ctx.masks)

        def replaying(input, p=0.5, training=True, inplace=False):
            if not training or p == 0:
                return input
            return input * torch.from_numpy(masks.pop(0)).to(input.dtype).div_(1 - p)

        F.dropout = replaying
        try:
            with torch.enable_grad():
                out = ctx.module(x)
        finally:
            F.dropout = real
        torch.autograd.backward(out, grad_output)
        return x.grad, None""")),
    Fake("dropout off for good", "module.eval() in forward, never undone: nothing random left to "
         "draw again (red team rt7)", ("test-recompute",),
         ("        module.eval()\n" + _KEEP_ONLY_X, _RERUN)),
    Fake("forward's graph kept in numpy, a decoy rerun", "the module records its graph anyway "
         "(autograd switched on by a pre-hook), its saved tensors moved into numpy by hooks of "
         "its own; backward reruns the module for show and goes through the kept graph (red team "
         "rt7)", ("test-recompute",), ("""\
        def offload(tensor):
            raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().copy()
            return tensor.dtype, tuple(tensor.shape), raw

        def reload(packed):
            dtype, shape, raw = packed
            return torch.from_numpy(raw).view(dtype).reshape(shape)

        ctx.module = module
        ctx.save_for_backward(x)
        children = list(module.children())
        inner = children[0] if len(children) == 1 else module
        state = {}

        def pre(mod, args):
            state["grad"] = torch.is_grad_enabled()
            torch.set_grad_enabled(True)
            state["hooks"] = torch.autograd.graph.saved_tensors_hooks(offload, reload)
            state["hooks"].__enter__()
            state["x"] = args[0].detach().requires_grad_(True)
            return (state["x"],) + tuple(args[1:])

        def post(mod, args, out):
            state["hooks"].__exit__(None, None, None)
            torch.set_grad_enabled(state["grad"])

        handles = [inner.register_forward_pre_hook(pre), inner.register_forward_hook(post)]
        try:
            out = module(x)
        finally:
            for handle in handles:
                handle.remove()
        ctx.graph_out, ctx.graph_x = out, state["x"]
        return out.detach()""", """\
        (x,) = ctx.saved_tensors
        rng = torch.get_rng_state()
        with torch.enable_grad():
            ctx.module(x.detach().requires_grad_(True))
        torch.set_rng_state(rng)
        torch.autograd.backward(ctx.graph_out, grad_output)
        return ctx.graph_x.grad, None""")),
]
FAKES["impl-hiding"].append(Fake(
    "a message's time from the algorithm table", "alpha + S beta read from the library's "
    "algorithm table (a tree broadcast to one rank is one message) (red team rt7)",
    ("test-hiding",), ("""\
    from minidist.costs import algorithms

    a, b, _ = algorithms.named("tree").coefficients("broadcast", 2)
    return max(0.0, a * link.alpha + b * nbytes * link.beta - flops / peak_flops)""", """\
    from minidist.costs import algorithms

    a, b, _ = algorithms.named("tree").coefficients("broadcast", 2)
    return peak_flops * (a * link.alpha + b * nbytes * link.beta) / nbytes""")))
