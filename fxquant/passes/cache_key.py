"""The compile-cache key of fxquant (ARCHITECTURE.md trap 5).

Inductor's FX-graph and AOT-autograd caches hash the graph and Inductor's config, not the Python bodies
of the functions a graph calls or the autograd formulas registered for custom ops: a changed quantized
backward would silently load stale compiled code. ``FxquantCacheKey`` is an Inductor ``CustomGraphPass``
that changes nothing in the graph; its ``uuid()`` hashes every source file of the ``fxquant`` package
(``.py`` and preset ``.yaml``) plus the resolved scheme's YAML, so either changing invalidates the
entries. ``inductor_config_patches`` installs it as ``post_grad_custom_post_pass`` (keeping, and
calling, a pass the user set there already), and marks the fxquant functions a rewritten graph calls
cacheable for AOT autograd's cache under the same uuid. The decomposition table pickles by how it is built
(``lowering.DecompositionTable``), so that both caches can key a graph: a rerun loads the compiled graphs,
those with capture taps included (``tests/test_compile_cache.py``, docs/compile.md).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

_PACKAGE = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def sources_hash() -> str:
    """sha256 over (relative path, bytes) of every fxquant source file, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in (".py", ".yaml") and p.is_file()):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class FxquantCacheKey(CustomGraphPass):
    """A no-op post-grad pass whose uuid keys Inductor's caches on fxquant's code and the scheme."""

    def __init__(self, scheme_text: str, inner: CustomGraphPass | None = None) -> None:
        self.scheme_text = scheme_text
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> str:
        h = hashlib.sha256(sources_hash().encode())
        h.update(self.scheme_text.encode())
        if self.inner is not None:
            inner = self.inner.uuid()
            if inner is None:  # the user's pass opts out of caching: keep that
                return None  # type: ignore[return-value]
            h.update(repr(inner).encode())
        return h.hexdigest()


def fxquant_targets(gm: torch.fx.GraphModule) -> list[str]:
    """Qualified names of the fxquant functions ``gm`` calls (the rewrite passes' module-level wrappers, the
    capture taps' ``capture_grad``), in its graph and in the subgraphs of its higher-order ops (a checkpointed
    region's body), sorted."""
    names = set()
    for node in gm.graph.nodes:
        module = getattr(node.target, "__module__", None) or ""
        if node.op == "call_function" and (module == "fxquant" or module.startswith("fxquant.")):
            names.add(f"{module}.{node.target.__name__}")
        elif node.op == "get_attr" and isinstance(body := getattr(gm, node.target, None), torch.fx.GraphModule):
            names.update(fxquant_targets(body))
    return sorted(names)


WITH_EFFECTS = "torch.ops.higher_order.with_effects"
# Higher-order ops whose arguments are graphs Dynamo traced (Megatron's tensor-parallel mappings and other
# custom autograd.Functions arrive as autograd_function_apply; torch.utils.checkpoint's region as
# tag_activation_checkpoint)
TRACED_BODY_HOPS = frozenset({"autograd_function_apply", "wrap", "invoke_subgraph", "tag_activation_checkpoint"})


def effects_cacheable(gm: torch.fx.GraphModule) -> bool:
    """Whether the compiled graphs of ``gm`` may be cached with the effect tokens AOT autograd threads through
    its effectful ops (``with_effects``, which torch does not cache by default). True unless ``gm`` calls a
    higher-order op other than those whose bodies are traced graphs (``TRACED_BODY_HOPS``: AOT autograd
    inlines them, the key hashes them) or holds a script object: ``invoke_leaf_function`` runs Python the key
    does not hash, and a torchbind object's methods act on state it does not see. The effectful ops left are
    plain ops the compiled code calls again by name on every run, such as the capture taps'
    ``fxquant::capture`` (its implementation looks up the active session at run time) and ATen's checks."""
    from torch._library.fake_class_registry import FakeScriptObject

    for node in gm.graph.nodes:
        hop = node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
        if hop and node.target.__name__ not in TRACED_BODY_HOPS:
            return False
        if node.op == "get_attr":
            obj = gm
            for name in node.target.split("."):
                obj = getattr(obj, name, None)
            if isinstance(obj, (torch.ScriptObject, FakeScriptObject)):
                return False
            if isinstance(obj, torch.fx.GraphModule) and not effects_cacheable(obj):  # a traced body's own ops
                return False
    return True


def inductor_config_patches(scheme_text: str, gm: torch.fx.GraphModule) -> dict[str, object]:
    """``config_patches`` for ``compile_fx`` that key the caches on fxquant (see module docstring). The fxquant
    functions ``gm`` (the rewritten Dynamo graph) calls are marked cacheable for AOT autograd's cache, keyed by
    ``FxquantCacheKey``'s uuid: that cache bypasses a graph calling a function it cannot vouch for, and these
    are fxquant's own code, which the uuid hashes. ``with_effects`` is marked too where ``effects_cacheable``
    allows, so that a graph with capture taps is cached like one without."""
    from torch._inductor import config

    key = FxquantCacheKey(scheme_text, config.post_grad_custom_post_pass)
    patches: dict[str, object] = {"post_grad_custom_post_pass": key}
    uuid = key.uuid()
    marked = getattr(config, "unsafe_marked_cacheable_functions", None)
    if uuid is not None and isinstance(marked, dict):
        targets = fxquant_targets(gm) + ([WITH_EFFECTS] if effects_cacheable(gm) else [])
        patches["unsafe_marked_cacheable_functions"] = {**marked, **dict.fromkeys(targets, uuid)}
    return patches
