"""Pass: quantize Megatron's Column/RowParallelLinear inside its ``autograd_function_apply`` bodies.

Dynamo captures ``LinearWithGradAccumulationAndAsyncCommunication`` as
``higher_order.autograd_function_apply(fwd_body, bwd_body, weight, input, bias, ...)``. Replacing the node
would drop the tensor/sequence-parallel communication and gradient accumulation written in those bodies,
so this pass inserts ``fxquant::quantize`` nodes in front of the GEMMs *inside* them (ARCHITECTURE.md):

    fwd_body  output = matmul(total_input, weight.t())      fprop: a = X along -1 (K), b = W^T along -2 (K)
    bwd_body  grad_input = grad_output.matmul(weight)      dgrad: a = dY along -1 (N), b = W along -2 (N)
              grad_weight = grad_output.t().matmul(x)      wgrad: a = dY^T along -1 (M), b = X along -2 (M)

Which backward GEMM is which is read from data flow, not position: an operand derived from the body's
grad placeholder is dY; the other derives from a saved tensor, which the fwd body's output maps back to
the forward's weight or input placeholder. Anything unexpected leaves the bodies untouched and marks
the site FAILED (strict mode raises on it).
"""
from __future__ import annotations

import dataclasses

from torch import fx

from fxquant.passes.graph_edit import insert_quantize
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status, body_modules, is_matmul, matmul_name

FPROP, DGRAD, WGRAD = "fprop", "dgrad", "wgrad"


def _placeholder_ancestors(node: object) -> set[fx.Node]:
    if not isinstance(node, fx.Node):
        return set()
    seen, todo, out = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            out.add(n)
        todo.extend(n.all_input_nodes)
    return out


def _mm_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_matmul(n) or matmul_name(n) == "linear"]


def _operands(mm: fx.Node) -> tuple[object, object]:
    return mm.args[0], mm.args[1]


def _fprop(fwd: fx.GraphModule) -> tuple[fx.Node | None, set[fx.Node], set[fx.Node], str]:
    """(fprop matmul, placeholders its input derives from, the weight's placeholder, note if unrecognised)."""
    f_mms = _mm_nodes(fwd.graph)
    if len(f_mms) != 1:
        return None, set(), set(), f"fwd_body has {len(f_mms)} matmul-like ops (expected one torch.matmul)"
    if matmul_name(f_mms[0]) not in ("matmul", "mm"):
        return None, set(), set(), (f"fwd_body's GEMM is {matmul_name(f_mms[0])}: an autograd.Function's linear is "
                                    f"recognised when its forward computes it with torch.matmul or mm, as "
                                    f"Megatron's do")
    a, b = _operands(f_mms[0])
    x_ph, w_ph = _placeholder_ancestors(a), _placeholder_ancestors(b)
    if len(w_ph) != 1 or not x_ph or w_ph & x_ph:
        return f_mms[0], x_ph, w_ph, "cannot tell the weight from the input in fwd_body's matmul"
    return f_mms[0], x_ph, w_ph, ""


def operand_positions(fwd: fx.GraphModule) -> tuple[int, int] | None:
    """(input, weight) positions among the ``autograd_function_apply`` node's tensor arguments (its
    ``args[2:]``, one per fwd_body placeholder), read from the fprop matmul's data flow; None if unclear."""
    fprop, x_ph, w_ph, note = _fprop(fwd)
    if fprop is None or note or len(x_ph) != 1:
        return None
    phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    return phs.index(next(iter(x_ph))), phs.index(next(iter(w_ph)))


def body_outputs(fwd: fx.GraphModule) -> tuple[int, list]:
    """(how many outputs the fwd_body returns, which is how many gradients the bwd_body receives first; the tensors
    it saves for the bwd_body, whose placeholders follow those gradients in this order)."""
    out = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
    return len(out[0]), list(out[1])


def locate_gemms(fwd: fx.GraphModule, bwd: fx.GraphModule) -> tuple[dict[str, fx.Node], str]:
    """``{"fprop": node, "dgrad": node, "wgrad": node}`` found in the bodies, and a note on what is missing."""
    fprop, x_ph, w_ph, note = _fprop(fwd)
    if fprop is None:
        return {}, note
    if note:
        return {FPROP: fprop}, note
    n_grads, saved = body_outputs(fwd)
    origin = [_placeholder_ancestors(s) for s in saved]
    b_phs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    grads, saved_phs = set(b_phs[:n_grads]), b_phs[n_grads:]
    role: dict[fx.Node, str] = {}
    for ph, org in zip(saved_phs, origin):
        if org & w_ph:
            role[ph] = "w"
        elif org & x_ph:
            role[ph] = "x"
    found = {FPROP: fprop}
    for mm in _mm_nodes(bwd.graph):
        ba, bb = _operands(mm)
        a_anc, b_anc = _placeholder_ancestors(ba), _placeholder_ancestors(bb)
        roles = {role.get(p) for p in b_anc}
        if a_anc & grads and not (b_anc & grads):
            if roles == {"w"}:
                found.setdefault(DGRAD, mm)
            elif roles == {"x"}:
                found.setdefault(WGRAD, mm)
    missing = [g for g in (DGRAD, WGRAD) if g not in found]
    return found, f"bwd_body has no recognisable {' / '.join(missing)} GEMM" if missing else ""


def rewrite_megatron_linear(gm: fx.GraphModule, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op is not OpKind.MEGATRON_LINEAR or meta.config is None:
        return meta
    fwd, bwd = body_modules(gm, node)
    found, note = locate_gemms(fwd, bwd)
    lq = meta.config
    wanted = {g: getattr(lq, g) for g in (FPROP, DGRAD, WGRAD) if getattr(lq, g).quantized}
    missing = [g for g in wanted if g not in found]
    if missing:
        failed = dataclasses.replace(meta, status=Status.FAILED, note=note or f"no {missing} GEMM found")
        node.meta[META_KEY] = failed
        return failed
    calls = [0, 0]
    for gemm, gq in wanted.items():
        mm = found[gemm]
        body = fwd if gemm == FPROP else bwd
        a, b = _operands(mm)
        new_args = list(mm.args)
        for i, (operand, tq, dim) in enumerate(((a, gq.a, -1), (b, gq.b, -2))):
            if tq is not None:
                new_args[i] = insert_quantize(body.graph, mm, operand, tq.spec(), dim)
                calls[gemm != FPROP] += 1
        mm.args = tuple(new_args)
    fwd.recompile()
    bwd.recompile()
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=tuple(calls))
    node.meta[META_KEY] = done
    return done
