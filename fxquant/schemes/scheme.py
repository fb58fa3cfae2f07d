"""``Scheme``: a named, ordered set of rules that says, per site, how every GEMM operand is quantized.

Resolution (which rule decides a site) is in ``fxquant.schemes.rules``; the YAML form in
``fxquant.schemes.yaml_io``; presets in ``fxquant.schemes.presets``. docs/schemes.md is the user guide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes.model import (
    AttentionQuant,
    Component,
    LinearQuant,
    Site,
    attention_operands,
    linear_operands,
)
from fxquant.schemes.rules import Rule, UnmatchedRule, explain_unmatched, winner


def _fmt(tq: TensorQuant | None) -> str:
    if tq is None:
        return "-"
    return tq.format if tq == TensorQuant(tq.format) else f"{tq.format}({tq.options.describe()})"


@dataclass(frozen=True)
class Scheme:
    """Rules resolved per site: ``linear_for(site)`` / ``attention_for(site)`` give what to quantize there."""

    name: str
    description: str = ""
    rules: tuple[Rule, ...] = ()
    source: str | None = field(default=None, compare=False)  # the YAML file it was read from, if any

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"Scheme.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"Scheme.description must be a str, got {self.description!r}")
        object.__setattr__(self, "name", self.name.strip())  # as the YAML reader keeps them: to_yaml() round trips
        object.__setattr__(self, "description", self.description.strip())
        object.__setattr__(self, "rules", tuple(self.rules))
        for i, r in enumerate(self.rules):
            if not isinstance(r, Rule):
                raise TypeError(f"Scheme.rules[{i}] must be a Rule, got {type(r).__name__}")

    # -- resolution --------------------------------------------------------------------------------------
    def rule_for(self, site: Site) -> Rule | None:
        """The rule that decides ``site`` (None: no rule applies, the site stays in high precision)."""
        return winner(self.rules, site)

    def linear_for(self, site: Site) -> LinearQuant | None:
        """What to quantize at a linear site; None when nothing is (no rule, or its rule keeps it high)."""
        if site.kind.component is not Component.LINEAR:
            raise ValueError(f"linear_for: site {site.module_path!r} has kind {site.kind.value!r}, not a linear kind")
        rule = self.rule_for(site)
        return rule.linear if rule is not None and rule.linear.quantized else None

    def attention_for(self, site: Site) -> AttentionQuant | None:
        """What to quantize at an attention site; None when nothing is."""
        if site.kind.component is not Component.ATTENTION:
            raise ValueError(f"attention_for: site {site.module_path!r} has kind {site.kind.value!r}, not 'attention'")
        rule = self.rule_for(site)
        return rule.attention if rule is not None and rule.attention.quantized else None

    def unmatched_rules(self, sites: list[Site]) -> list[UnmatchedRule]:
        """The rules that match none of ``sites``, each with a reason and the nearest module paths."""
        sites = list(sites)
        return [
            explain_unmatched(i, rule, sites)
            for i, rule in enumerate(self.rules)
            if not any(rule.applies_to(s) for s in sites)
        ]

    @property
    def quantizes_anything(self) -> bool:
        return any(
            (r.linear is not None and r.linear.quantized) or (r.attention is not None and r.attention.quantized)
            for r in self.rules
        )

    # -- YAML ---------------------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> "Scheme":
        """Read a scheme YAML file; every problem is reported at once as ``file:line: dotted.path: message``."""
        from fxquant.schemes.yaml_io import load_file

        return load_file(path)

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "<string>") -> "Scheme":
        from fxquant.schemes.yaml_io import load_text

        return load_text(text, source)

    def to_yaml(self) -> str:
        """The YAML text of this scheme; ``Scheme.from_yaml_text(s.to_yaml()) == s``."""
        from fxquant.schemes.yaml_io import dump

        return dump(self)

    # -- description -------------------------------------------------------------------------------------
    def describe(self) -> str:
        """A table of the rules: selector, priority, and each GEMM operand's format."""
        from tabulate import tabulate

        rows = []
        for i, r in enumerate(self.rules):
            sel = r.selector.describe() + (f" priority={r.priority}" if r.priority else "")
            if r.linear is not None:
                for gemm, ops in linear_operands(r.linear).items():
                    rows.append([i, sel, "linear", gemm, *(f"{k}={_fmt(v)}" for k, v in ops.items())])
                    sel = ""
            if r.attention is not None:
                for gemm, ops in attention_operands(r.attention).items():
                    rows.append([i, sel, "attention", gemm, *(f"{k}={_fmt(v)}" for k, v in ops.items())])
                    sel = ""
        head = f"scheme {self.name}" + (f": {self.description}" if self.description else "")
        if not rows:
            return head + "\n(no rules: every GEMM stays in high precision)"
        table = tabulate(rows, headers=["rule", "selector", "component", "gemm", "operand a", "operand b"])
        return f"{head}\n{table}"

    def __str__(self) -> str:
        return self.name
