"""Layer numbering of sites: the global index of a module path's transformer layer (issue 3/4, PP).

A site's layer comes from ``layers.N`` in its module path (``Site.from_path``), which is the index in the
*local* layer stack. Under pipeline parallelism each stage holds a slice of the layers and its stack
restarts at 0, so scheme layer selectors (``layers: [0]``, ``first_layers``/``last_layers``), explain
output and capture records' ``layer`` would name the wrong layer. ``LayerNumbering`` maps a local path to
the global index:

- explicit: ``layer_offset=k`` (``fxquant.compile(..., layer_offset=k)``): global = local + k;
- automatic (the default): a layer module that carries an int ``layer_number`` attribute (Megatron-core's
  ``TransformerLayer``: 1-based and global across pipeline and virtual-pipeline stages) gives
  ``layer_number - 1``; without one, the local index is kept (offset 0).

``num_layers`` (for ``last_layers`` and negative indices) is the whole model's count: explicit, else the
model's ``config.num_layers`` when its layers carry ``layer_number`` (Megatron), else 1 + the largest index.
A model with several layer stacks and neither (an encoder-decoder's ``encoder.block.N`` and ``decoder.block.N``)
counts each stack on its own (``stack_layers``): ``last_layers: 1`` selects the last block of each.

The numbering also knows the model's LM heads beyond their names (``heads``): the module Hugging Face's
``get_output_embeddings()`` returns (BERT's ``cls.predictions.decoder``, RoBERTa's ``lm_head.decoder``) and any
linear whose weight is an embedding's weight (tied); their sites get kind ``lm_head``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from fxquant.schemes.model import Site, SiteKind, layer_stack


def _layer_prefix(path: str) -> str | None:
    """``decoder.layers.1`` for ``decoder.layers.1.mlp.linear_fc1`` (None outside a layer stack): the path up to
    its outermost layer stack, as ``Site.from_path`` reads it (``schemes.model.layer_stack``)."""
    m = layer_stack(path)
    return path[: m.end()] if m else None


def with_layer(path: str, layer: int) -> str:
    """``path`` with the index of its outermost layer stack replaced by ``layer`` (``decoder.layers.0.mlp`` ->
    ``decoder.layers.3.mlp``)."""
    m = layer_stack(path)
    return path if m is None else path[: m.start(1)] + str(layer) + path[m.end(1):]


def _check_count(name: str, value: object, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name}={value!r}: must be None or an int >= {minimum}")


@dataclass(frozen=True)
class LayerNumbering:
    """Local module path -> Site with the global layer index (module docstring)."""

    offset: int = 0
    num_layers: int | None = None
    numbers: dict[str, int] = field(default_factory=dict)  # layer module path -> global index
    heads: frozenset[str] = frozenset()  # module paths of LM heads whose names do not say so (module docstring)
    stack_layers: dict[str, int] = field(default_factory=dict)  # stack path -> its layer count (module docstring)

    def __post_init__(self) -> None:
        _check_count("layer_offset", self.offset, 0)
        _check_count("num_layers", self.num_layers, 1)

    def layer(self, path: str) -> int | None:
        prefix = _layer_prefix(path)
        if prefix is None:
            return None
        if prefix in self.numbers:
            return self.numbers[prefix]
        return int(prefix.rsplit(".", 1)[1]) + self.offset

    def site(self, path: str, kind: SiteKind | str | None = None) -> Site:
        if kind is None and path in self.heads:
            kind = SiteKind.LM_HEAD
        local = Site.from_path(path, kind)
        layer = self.layer(path)
        prefix = _layer_prefix(path)
        count = self.stack_layers.get(prefix.rsplit(".", 1)[0], self.num_layers) if prefix else self.num_layers
        return dataclasses.replace(local, layer=layer, num_layers=count,
                                   global_path=None if layer == local.layer else with_layer(path, layer))

    def is_stage(self, sites: list[Site]) -> bool:
        """Whether ``sites`` hold only some of the model's ``num_layers`` layers (a pipeline stage's)."""
        held = {s.layer for s in sites if s.layer is not None}
        return self.num_layers is not None and bool(held) and len(held) < self.num_layers

    def other_stages(self, sites: list[Site]) -> list[Site]:
        """For a pipeline stage (a slice of the global layers): the sites of one layer it holds again for each
        global layer it does not hold (with their global paths), i.e. what the other stages show if their layers
        are built like this one's; nothing when the stage holds every layer. A scheme rule that selects only other
        stages' layers (``layers: [5]``, ``last_layers: 1`` on the first stage) matches these, so it is not taken
        for a rule matching nothing; a ``modules`` rule, which may name a module only other stages' layers have
        (DeepSeek-V2-Lite's dense first layer), is not checked on a stage at all (``strict.unmatched_rule_error``)."""
        if not self.is_stage(sites):
            return []
        held = sorted({s.layer for s in sites if s.layer is not None})
        template = [s for s in sites if s.layer == held[0]]
        return [dataclasses.replace(s, layer=j, global_path=with_layer(s.module_path, j))
                for j in range(self.num_layers) if j not in held for s in template]

    @classmethod
    def of_model(cls, model: nn.Module | None, *, layer_offset: int | None = None,
                 num_layers: int | None = None) -> "LayerNumbering":
        """The numbering of ``model``'s sites (module docstring); ``layer_offset`` disables the automatic one."""
        _check_count("layer_offset", layer_offset, 0)
        _check_count("num_layers", num_layers, 1)
        if model is None:
            return cls(layer_offset or 0, num_layers)
        numbers: dict[str, int] = {}
        local: list[int] = []
        stacks: dict[str, int] = {}
        for name, mod in model.named_modules():
            prefix = _layer_prefix(name)
            if prefix != name:
                continue
            stack, index = name.rsplit(".", 1)
            local.append(int(index))
            stacks[stack] = max(stacks.get(stack, 0), int(index) + 1)
            number = getattr(mod, "layer_number", None)
            if layer_offset is None and isinstance(number, int) and not isinstance(number, bool) and number >= 1:
                numbers[name] = number - 1
        if num_layers is None and numbers:
            configured = getattr(getattr(model, "config", None), "num_layers", None)
            num_layers = configured if isinstance(configured, int) and configured > max(numbers.values()) else None
        found = list(numbers.values()) or [i + (layer_offset or 0) for i in local]
        top = max(found) if found else None
        per_stack = {}
        if num_layers is None:
            num_layers = None if top is None else top + 1
            if not numbers and layer_offset is None and len(stacks) > 1:
                per_stack = stacks
        elif top is not None and top >= num_layers:
            raise ValueError(f"num_layers={num_layers}: the model has a layer with global index {top}")
        return cls(layer_offset or 0, num_layers, numbers, _lm_heads(model), per_stack)


def _lm_heads(model: nn.Module) -> frozenset[str]:
    """Paths of the linears that are the model's LM head without a head's name: ``get_output_embeddings()``'s
    module (Hugging Face) and linears whose weight is an ``nn.Embedding``'s weight."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings}
    getter = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError, TypeError):  # a model class without an output embedding
            head = None
    if isinstance(head, nn.Module):
        out.update(name for name, m in model.named_modules() if m is head)
    return frozenset(out)
