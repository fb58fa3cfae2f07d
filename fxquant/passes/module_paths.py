"""Module paths of Dynamo graph nodes, read from ``node.meta["nn_module_stack"]`` (ARCHITECTURE.md).

Dynamo names a module by how the compiled frame reached it: ``L['self'].layers.0.mlp`` (newer releases
also spell it ``L['self']._modules['layers']._modules['0']``), ``L['fn'].``, ``G['m'].``. After a graph
break the resumed frame's root is the inner module, so the spelled path loses its prefix
(``L['self'].q_proj`` inside ``layers.0.self_attn``). The stack's keys, however, identify the module
object (``str(id(module))`` on torch 2.11-2.13), so with the root model's ``named_modules()`` the full
path is recovered exactly; the spelled path is the fallback.
"""
from __future__ import annotations

import re

import torch
from torch import fx

_ROOT_RE = re.compile(r"^(?:[LG]\[['\"][^'\"]*['\"]\])\.?")
_ITEM_RE = re.compile(r"(?:\._modules)?\[['\"]?([^'\"\]]+)['\"]?\]")


def normalize(dynamo_path: str) -> str:
    """``L['self'].layers.0.mlp`` / ``L['self']._modules['layers']._modules['0']`` -> ``layers.0.mlp``."""
    path = _ROOT_RE.sub("", dynamo_path, count=1)
    path = _ITEM_RE.sub(lambda m: "." + m.group(1), path)
    return path.strip(".")


class ModuleNames:
    """Maps the modules of one root model to their qualified names (``named_modules()``)."""

    def __init__(self, root: torch.nn.Module | None) -> None:
        self._by_id: dict[str, str] = {}
        self._param_owner: dict[int, str] = {}  # id(parameter) -> path of the module owning it
        self._embedding_weights: set[int] = set()  # id() of every nn.Embedding's weight
        self._class_count: dict[type, int] = {}  # modules of each class (passes.instances)
        if root is not None:
            for name, mod in root.named_modules(remove_duplicate=False):
                if self._by_id.setdefault(str(id(mod)), name) == name:
                    self._class_count[type(mod)] = self._class_count.get(type(mod), 0) + 1
                if isinstance(mod, torch.nn.Embedding):
                    self._embedding_weights.add(id(mod.weight))
            for name, param in root.named_parameters(remove_duplicate=False):
                self._param_owner.setdefault(id(param), name.rpartition(".")[0])

    @staticmethod
    def _parameter(arg: object) -> torch.nn.Parameter | None:
        """The model parameter a placeholder node stands for (Dynamo's graph argument), else None."""
        if not isinstance(arg, fx.Node) or arg.op != "placeholder":
            return None
        grapharg = arg.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        return example if isinstance(example, torch.nn.Parameter) else None

    def is_embedding_weight(self, arg: object) -> bool:
        """Whether graph node ``arg`` is an ``nn.Embedding``'s weight (by identity): a linear with it as its weight
        is a tied LM head whatever the names (``F.linear(h, self.tok_emb.weight)``)."""
        param = self._parameter(arg)
        return param is not None and id(param) in self._embedding_weights

    def param_owner(self, node: fx.Node, extra: tuple = ()) -> str | None:
        """For a GEMM node without a module stack (a module method called in its own compiled frame, e.g. an
        MoE router's gating): the path of the module owning one of its parameter operands, found by identity
        through the placeholder's graph argument (looking through one transpose), or of one of the ``extra`` nodes
        (a caller's weight looked through casts and views). None when none is known."""
        for arg in (*node.args, *node.kwargs.values(), *extra):  # F.linear(h, weight=w) too; extra: other nodes
            if isinstance(arg, fx.Node) and _is_transpose(arg):
                arg = arg.args[0]
            param = self._parameter(arg)
            if param is not None and id(param) in self._param_owner:
                return self._param_owner[id(param)]
        return None

    def path_of(self, obj: object) -> str | None:
        """The qualified name of a module of the root model (None for any other object)."""
        return self._by_id.get(str(id(obj))) if isinstance(obj, torch.nn.Module) else None

    def owner_of(self, param: object) -> str | None:
        """The path of the module owning a parameter of the root model (None for any other object)."""
        return self._param_owner.get(id(param))

    def shares_class(self, module: torch.nn.Module) -> bool:
        """Whether the root model holds another module of ``module``'s class."""
        return self._class_count.get(type(module), 0) > 1

    def path_of_entry(self, key: str, dynamo_path: str) -> str:
        """The qualified name of one ``nn_module_stack`` entry: exact by module identity, else spelled."""
        return self._by_id.get(str(key), normalize(dynamo_path))

    def node_path(self, node: fx.Node) -> str | None:
        """The innermost module path of ``node``; None when the node has no module stack."""
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return None
        key, (dynamo_path, _cls) = list(stack.items())[-1]
        return self.path_of_entry(key, dynamo_path)

    def node_stack(self, node: fx.Node) -> list[tuple[str, type]]:
        """The whole module stack of ``node``, outermost first, as (qualified path, module class)."""
        stack = node.meta.get("nn_module_stack") or {}
        return [(self.path_of_entry(k, p), cls) for k, (p, cls) in stack.items()]

    def frame_root(self, graph: fx.Graph) -> str | None:
        """The module path the compiled frame started from (``""`` for the root model), inferred from any
        node whose identity-resolved path ends with its spelled path; None when no node tells."""
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if not stack:
                continue
            for key, (dynamo_path, _cls) in stack.items():
                full = self._by_id.get(str(key))
                spelled = normalize(dynamo_path)
                if full is None:
                    continue
                if full == spelled:
                    return ""
                if full.endswith("." + spelled):
                    return full[: -len(spelled) - 1]
        return None


def _is_transpose(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in ("t", "transpose")


def class_name(cls: object) -> str:
    return getattr(cls, "__name__", str(cls))
