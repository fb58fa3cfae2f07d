"""``Explanation``: what ``fxquant.explain`` found, as data and as the table ``fxquant explain`` prints.

One row per GEMM of every matched site (module path, layer, kind, op, GEMM, each operand's format,
``-`` = high precision), then every matmul-like op no pattern matched (it stays in high precision), opaque
GEMM-containing calls (``passes.opaque``) with a note saying what they hide.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.passes.sites import OpKind, SiteMeta, Status, UnmatchedOp
from fxquant.schemes.model import AttentionQuant, LinearQuant, attention_operands, linear_operands
from fxquant.schemes.rules import UnmatchedRule
from fxquant.schemes.scheme import Scheme

_ATTENTION_GEMMS = {
    OpKind.SDPA: ("qk", "dq", "dk", "pv", "dp", "dv"),
    OpKind.ATTENTION_WEIGHTS: ("qk", "dq", "dk", "pv", "dp", "dv"),
    OpKind.UNFUSED_QK: ("qk", "dq", "dk"),
    OpKind.UNFUSED_PV: ("pv", "dp", "dv"),
}


def operand_table(meta: SiteMeta) -> dict[str, dict[str, str]]:
    """``{gemm: {operand: format spec or "-"}}`` of one site (all GEMMs, high precision included; a site the
    passes refuse, status ``failed``, runs every GEMM in high precision)."""
    cfg = None if meta.status is Status.FAILED else meta.config
    if meta.op in _ATTENTION_GEMMS:
        table = attention_operands(cfg if isinstance(cfg, AttentionQuant) else AttentionQuant())
        table = {g: table[g] for g in _ATTENTION_GEMMS[meta.op]}
    else:
        table = linear_operands(cfg if isinstance(cfg, LinearQuant) else LinearQuant())
    return {g: {k: short_format(tq) for k, tq in ops.items()} for g, ops in table.items()}


def short_format(tq: TensorQuant | None) -> str:
    """``-`` for high precision, the format name when its options are the defaults, else the full spec."""
    if tq is None:
        return "-"
    return tq.format if tq == TensorQuant(tq.format) else tq.spec()


@dataclass(frozen=True)
class Explanation:
    scheme: Scheme
    sites: list[SiteMeta]
    unmatched: list[UnmatchedOp]
    graphs: int
    unmatched_rules: list[UnmatchedRule]
    kernels: str = ""  # the quantize implementation compile would use, described (fxquant.lowering)

    @property
    def selected(self) -> list[SiteMeta]:
        """Sites the scheme quantizes and compile would rewrite."""
        return [s for s in self.sites if s.selected and s.status is not Status.FAILED]

    @property
    def refused(self) -> list[SiteMeta]:
        """Sites the scheme selects that compile would not rewrite (high precision; ``note`` says why)."""
        return [s for s in self.sites if s.status is Status.FAILED]

    def rows(self) -> list[list[str]]:
        out = []
        for s in self.sites:
            first = True
            for gemm, ops in operand_table(s).items():
                head = [s.site.module_path or "<root>", "" if s.site.layer is None else str(s.site.layer),
                        s.site.kind.value, s.op.value] if first else ["", "", "", ""]
                out.append(head + [gemm, "  ".join(f"{k}={v}" for k, v in ops.items())])
                first = False
        return out

    def __str__(self) -> str:
        from tabulate import tabulate

        n_sel, n_refused = len(self.selected), len(self.refused)
        refused = f", {n_refused} refused (high precision, notes below)" if n_refused else ""
        lines = [f"scheme {self.scheme.name}: {len(self.sites)} sites matched, {n_sel} quantized{refused}; "
                 f"{len(self.unmatched)} matmul-like ops unmatched; {self.graphs} graph(s)"]
        if self.kernels:
            lines.append(f"quantize kernels: {self.kernels}")
        lines.append(tabulate(self.rows(), headers=["module", "layer", "kind", "op", "gemm", "operands"]))
        for site in self.refused:
            lines.append(f"refused: {site.site.module_path or '<root>'}: {site.note}")
        if self.unmatched:
            lines.append("\nunmatched matmul-like ops (high precision):")
            rows = [[u.module_path or "<root>", u.target, " x ".join(u.shapes), u.note, u.stack_line]
                    for u in self.unmatched]
            lines.append(tabulate(rows, headers=["module", "op", "shapes", "note", "source"]))
        for rule in self.unmatched_rules:
            lines.append(f"note: {rule}")
        return "\n".join(lines)
