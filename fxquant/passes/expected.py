"""How many ``fxquant::quantize`` calls a rewritten Dynamo graph makes per forward and per backward.

Read from the rewritten graph (after the rewrite passes): each wrapper call quantizes the operands its
specs name, a Megatron linear what the quantize nodes inside its bodies quantize. With AOT autograd's
training graphs (``dedupe=True``; its inference graphs, compiled under no_grad, are not CSE'd) common-subexpression elimination merges identical calls, e.g. the input X shared by
q_proj, k_proj and v_proj (or a Megatron MLA's q_proj and kv_down_proj, their bodies inlined) quantized with the
same spec along the same axis in fprop (and in wgrad), so
calls are counted once per (operand, spec, axis). An operand is known by its value, as CSE knows it: two nodes
that apply the same op to the same arguments (``torch.relu(x)`` or ``x.view(-1, d)`` written twice) are one
operand, unless the op draws random numbers (an active dropout) or the graph mutates a tensor in place (then
every node is its own operand). ``fxquant.counters`` compares this with what ran.

Backward GEMMs follow autograd: a gradient that autograd does not ask for is not computed, so its GEMM
quantizes nothing (a first linear whose input does not require grad has no dgrad; a frozen weight, no
wgrad), and a GEMM whose output does not require grad has no backward at all (a linear run under
``torch.no_grad()`` inside a training forward, such as a frozen teacher's). Whether an operand or the site's
output requires grad is read from its node's ``example_value`` (Dynamo's fake tensor, traced in the grad mode of
its region); a node without one is assumed to require grad.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from fxquant.passes import wrappers
from fxquant.passes.rewrite_megatron_linear import body_outputs
from fxquant.passes.sites import META_KEY, OpKind, Status, body_modules, checkpointed_bodies

_FWD, _BWD = 0, 1


def requires_grad(operand: object) -> bool:
    """Whether autograd will ask for the gradient of ``operand`` (a graph node; True when unknown)."""
    value = operand.meta.get("example_value") if isinstance(operand, fx.Node) else None
    return bool(getattr(value, "requires_grad", True)) if value is not None else isinstance(operand, fx.Node)


def output_requires_grad(node: fx.Node) -> bool:
    """Whether autograd records the site ``node``'s result (any tensor of it, for a tuple such as (O, P)): False
    for a site traced under no_grad, whose GEMMs then have no backward (True when unknown)."""
    value = node.meta.get("example_value")
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        return not tensors or any(t.requires_grad for t in tensors)
    return requires_grad(node)


def gemm_runs(node: fx.Node, a: object, b: object) -> list[bool]:
    """Per operand slot of a (fwd a, fwd b, grad_a dC, grad_a b, grad_b a, grad_b dC) table: whether it runs."""
    out = output_requires_grad(node)
    ga, gb = out and requires_grad(a), out and requires_grad(b)
    return [True, True, ga, ga, gb, gb]


def attention_runs(node: fx.Node, q: object, k: object, v: object) -> list[bool]:
    """Per operand slot of an attention site's (qk: fwd q, fwd k, dq ds, dq k, dk q, dk ds; pv: fwd p, fwd v,
    dp do, dp v, dv p, dv do) table: whether its GEMM runs."""
    out = output_requires_grad(node)
    gq, gk, gv = (out and requires_grad(t) for t in (q, k, v))
    p_grad = gq or gk  # P = softmax(Q K^T) needs a gradient iff Q or K does
    return [True, True, gq, gq, gk, gk, True, True, p_grad, p_grad, gv, gv]


_ADDS = frozenset({operator.add, operator.iadd, torch.add})
_ADD_METHODS = frozenset({"add", "add_", "__add__", "__iadd__"})


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' example values have one shape and dtype (an add between them neither broadcasts nor
    promotes, so its backward hands each operand the add's gradient itself)."""
    va, vb = a.meta.get("example_value"), b.meta.get("example_value")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype)


def gradient_node(node: fx.Node) -> fx.Node:
    """The node whose gradient is ``node``'s own gradient tensor: ``node`` itself, or, where its only user is a plain
    add of two tensors of its shape and dtype (a LoRA branch added to its base linear, parallel attention and MLP
    outputs summed), that add's (followed on). Sites whose outputs reach one such node receive one gradient tensor,
    so AOT autograd's CSE merges their identical dY quantizes."""
    while len(node.users) == 1:
        (user,) = node.users
        is_add = (user.op == "call_function" and user.target in _ADDS) or (
            user.op == "call_method" and user.target in _ADD_METHODS)
        if not is_add or len(user.args) != 2 or user.kwargs or not all(isinstance(a, fx.Node) for a in user.args):
            break
        if not (_same_value(node, user) and _same_value(user.args[0], user.args[1])):
            break
        node = user
    return node


# ops that draw random numbers (besides rand*, *dropout*): AOT autograd's CSE never merges two such calls
_RANDOM = frozenset({"bernoulli", "normal", "poisson", "multinomial", "rrelu", "uniform", "exponential", "geometric",
                     "cauchy", "log_normal", "binomial"})


def _random(name: str) -> bool:
    name = name.lower().strip("_")
    return name.startswith("rand") or "dropout" in name or name in _RANDOM
_MUTATING = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv})


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write a tensor in place (``x.add_()``, ``x[i] = y``, ``F.relu(x, inplace=True)``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name(node)
    return (node.target in _MUTATING or (name.endswith("_") and not name.endswith("__"))
            or node.kwargs.get("inplace") is True or "out" in node.kwargs)


def _dropout_identity(node: fx.Node) -> bool:
    """An ``F.dropout``-style call that returns its input: ``training=False`` or ``p=0`` (eval mode)."""
    if node.op != "call_function" or not _name(node).endswith("dropout") or not node.args:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False or (isinstance(p, (int, float)) and p == 0)


def _body_key(node: fx.Node) -> object:
    """The key of a ``get_attr`` node: a subgraph (an ``autograd_function_apply`` body) by its code, so the same
    function applied twice to one value is one value (Megatron's copy_to_tensor_model_parallel_region in front of
    each linear); anything else, and a body that draws random numbers or writes in place, by name."""
    owner = node.graph.owning_module
    body = getattr(owner, node.target, None) if owner is not None and isinstance(node.target, str) else None
    if not isinstance(body, fx.GraphModule):
        return node.name
    calls = [n for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    if any(_mutates(n) or _random(_name(n)) for n in calls):
        return node.name
    return ("body", body.code)


class _ValueKeys:
    """Keys of a graph's operand nodes, equal for two nodes that CSE merges (module docstring)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.by_name = any(_mutates(n) for n in graph.nodes)
        self.memo: dict[fx.Node, object] = {}

    def __call__(self, value: object) -> object:
        if isinstance(value, fx.Node):
            if value not in self.memo:
                self.memo[value] = self._node(value)
            return self.memo[value]
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *(self(v) for v in value))
        if isinstance(value, slice):
            return ("slice", self(value.start), self(value.stop), self(value.step))
        if isinstance(value, dict):
            return ("dict", *sorted((str(k), repr(self(v))) for k, v in value.items()))
        return (type(value).__name__, repr(value))

    def _node(self, node: fx.Node) -> object:
        if node.op == "get_attr" and not self.by_name:
            return _body_key(node)
        if self.by_name or node.op not in ("call_function", "call_method"):
            return node.name
        if _dropout_identity(node):
            return self(node.args[0] if node.args else node.kwargs["input"])
        if _random(_name(node)):
            return node.name
        return (node.op, node.target, self(node.args), self(dict(node.kwargs)))


def _operand_keys(node: fx.Node, key: _ValueKeys) -> list[tuple[int, tuple]]:
    """(phase, key) of every quantization a rewritten wrapper call makes; keys equal iff CSE merges them."""
    t, args = node.target, node.args
    if t is wrappers.fxquant_linear:
        x, w, s = args[0], args[1], args[3]
        wk, wn = "K", "N"
        if isinstance(w, fx.Node) and w.target is torch.t:  # Conv1D: w.t() of its [K, N] weight, a node per site
            w, wk, wn = w.args[0], "K of w.t()", "N of w.t()"
        dy = gradient_node(node)
        table = [(_FWD, x, "K"), (_FWD, w, wk), (_BWD, dy, "dY,N"), (_BWD, w, wn), (_BWD, dy, "dY,M"),
                 (_BWD, x, "M")]
        runs = gemm_runs(node, x, w)
    elif t in (wrappers.fxquant_matmul, wrappers.fxquant_bmm, wrappers.fxquant_baddbmm):
        a, b = (args[1], args[2]) if t is wrappers.fxquant_baddbmm else (args[0], args[1])
        s = args[-1]
        dc = gradient_node(node)
        table = [(_FWD, a, "-1"), (_FWD, b, "-2"), (_BWD, dc, "dC,-1"), (_BWD, b, "-1"), (_BWD, a, "-2"),
                 (_BWD, dc, "dC,-2")]
        runs = gemm_runs(node, a, b)
    elif t in (wrappers.fxquant_sdpa, wrappers.fxquant_attention_weights):  # operands private to the site
        s = args[-1]
        phases = [_FWD, _FWD, _BWD, _BWD, _BWD, _BWD] * 2
        runs = attention_runs(node, *args[:3])
        return [(ph, (node.name, i, spec)) for i, (ph, spec, run) in enumerate(zip(phases, s, runs))
                if spec is not None and run]
    else:
        return []
    return [(ph, (key(op), axis, spec)) for (ph, op, axis), spec, run in zip(table, s, runs)
            if spec is not None and run]


def _collective(node: fx.Node) -> bool:
    """Whether ``node`` calls a distributed collective (``torch.distributed``, functional collectives)."""
    if node.op not in ("call_function", "call_method"):
        return False
    where = f"{getattr(node.target, '__module__', '') or ''}.{_name(node)}".lower()
    return any(word in where for word in ("distributed", "c10d", "all_gather", "all_reduce", "reduce_scatter",
                                          "all_to_all"))


class _BodyKeys(_ValueKeys):
    """Value keys of an ``autograd_function_apply`` body's nodes: its placeholders are the values they stand for
    (``inputs``: a fwd_body's tensor arguments in the outer graph, a bwd_body's saved tensors in the fwd_body); its
    other placeholders and the nodes ``_ValueKeys`` keys by name (random ops, a graph with in-place writes) are
    private to the site (``scope``), as node names are per body."""

    def __init__(self, graph: fx.Graph, inputs: dict[fx.Node, object], scope: object) -> None:
        super().__init__(graph)
        self.inputs, self.scope = inputs, scope

    def _node(self, node: fx.Node) -> object:
        if node in self.inputs:
            return self.inputs[node]
        if _collective(node):  # communication (sequence parallelism's all-gather): not merged
            return (self.scope, node.name)
        k = super()._node(node)
        return (self.scope, k) if isinstance(k, str) else k


def _megatron_keys(node: fx.Node, key: _ValueKeys) -> list[tuple[int, tuple]]:
    """(phase, key) of every quantize the Megatron rewrite put in a site's bodies (``rewrite_megatron_linear``): AOT
    autograd inlines the bodies into its joint graph, so two linears on one input (DeepSeek's q_proj and
    kv_down_proj) quantize it once for fprop and once for wgrad. A body's input is keyed by the outer graph's value
    (``key``), a bwd_body's saved tensor by its fwd_body value, its incoming gradient by the node whose gradient it
    is (``gradient_node``: linears whose outputs are added receive one gradient tensor)."""
    bodies = body_modules(node.graph.owning_module, node)
    if bodies is None:
        return []
    fwd, bwd = bodies
    scope = ("megatron", node.name)
    f_phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    f_keys = _BodyKeys(fwd.graph, {ph: key(arg) for ph, arg in zip(f_phs, node.args[2:])}, scope)
    n_grads, saved = body_outputs(fwd)  # a rewritten site's bodies passed locate_gemms, which reads them so
    b_phs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    outputs = {u.args[1]: u for u in node.users
               if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)}
    # output i's incoming gradient: that of the add it feeds (``gradient_node``), shared by the sites added there
    inputs = {ph: ("gradient", key(gradient_node(outputs[i]))) if i in outputs else (scope, "grad", i)
              for i, ph in enumerate(b_phs[:n_grads])}
    inputs.update((ph, f_keys(s)) for ph, s in zip(b_phs[n_grads:], saved))
    b_keys = _BodyKeys(bwd.graph, inputs, scope)
    keys = []
    for phase, body, body_key in ((_FWD, fwd, f_keys), (_BWD, bwd, b_keys)):
        for q in body.graph.nodes:
            if q.op == "call_function" and q.target is torch.ops.fxquant.quantize.default:
                keys.append((phase, ("megatron quantize", body_key(q.args[0]), body_key(q.args[1:]))))
    return keys


def _rewritten(gm: fx.GraphModule) -> list[tuple[int, fx.Node]]:
    """(region, node) of every rewritten site node of ``gm``: region 0 for its own graph, else an id of the
    checkpointed region whose body holds it (``sites.checkpointed_bodies``)."""
    graphs = [(0, gm)] + [(id(body), body) for body in checkpointed_bodies(gm)]
    return [(region, node) for region, g in graphs for node in g.graph.nodes
            if (meta := node.meta.get(META_KEY)) is not None and meta.status is Status.REWRITTEN]


def recomputes(gm: fx.GraphModule) -> bool:
    """Whether a rewritten site of ``gm`` lies in a checkpointed region: its forward quantizes run again in the
    backward, as many as the backward needs (``torch.utils.checkpoint``'s recompute, or AOT autograd's
    partitioner with the region's tags), which ``expected_calls`` does not count."""
    return any(region for region, _ in _rewritten(gm))


def expected_calls(gm: fx.GraphModule, *, dedupe: bool) -> tuple[int, int]:
    """(forward, backward) quantize calls per step of the rewritten ``gm`` (a checkpointed region's recompute not
    included: ``recomputes``)."""
    keys: list[tuple[int, tuple]] = []
    counts = [0, 0]
    value_keys: dict[fx.Graph, _ValueKeys] = {}
    for region, node in _rewritten(gm):
        meta = node.meta[META_KEY]
        if node.graph not in value_keys:
            value_keys[node.graph] = _ValueKeys(node.graph)
        key = value_keys[node.graph]
        found = _megatron_keys(node, key) if meta.op is OpKind.MEGATRON_LINEAR else _operand_keys(node, key)
        keys.extend((phase, (region, k)) for phase, k in found)
    if dedupe:
        keys = list(dict.fromkeys(keys))
    for phase, _ in keys:
        counts[phase] += 1
    return counts[_FWD], counts[_BWD]

