"""Report figures written as SVG text: line, step, bar and heatmap panels with ticks, legends and colour bars.

Why not matplotlib's renderer: it spent 0.17-0.76 s per figure here (tick and text layout, rasterising, PNG),
and a report draws tens of figures, one set per format and layer grouping: on the 2-core CI box the figures
alone took twice as long as streaming a 2 GB capture set. Writing the SVG elements directly takes
milliseconds per figure; the browser lays out the text. The figures are vectors (zoom, paste into a paper),
deterministic (same bytes for the same data), and use matplotlib's colour maps and its ``tab10`` colours.

The API follows matplotlib's where it can (``subplots``, ``Axes.plot``, ``axvspan``, ``set_yscale``...), with
sizes in pixels of the *plot area*; margins grow to fit tick labels, titles, legends and colour bars. Text
widths are estimated (0.6 em per character), which is all the layout needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import numpy as np

TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_NAMED = {f"tab:{n}": c for n, c in zip(("blue", "orange", "green", "red", "purple", "brown", "pink", "gray", "olive",
                                         "cyan"), TAB10)}
_NAMED.update({"tab:grey": _NAMED["tab:gray"], "black": "#000000", "white": "#ffffff", "grey": "#808080",
               "gray": "#808080"})
_DASH = {"-": None, "solid": None, "--": "6,3", "dashed": "6,3", ":": "1.5,2.5", "dotted": "1.5,2.5", "-.": "6,2.5,1.5,2.5"}
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_TICK_FS, _LABEL_FS, _TITLE_FS = 10, 11, 12
NAN_CELL = "#dddddd"  # grey
# +-Inf cells: fixed colours in none of the report's colour maps (RdBu_r, viridis, magma), so an infinite value is
# never read as a large finite one at a map's saturated end
POS_INF_CELL = "#ff00ff"  # magenta
NEG_INF_CELL = "#00ffff"  # cyan
_KEY_W = 52.0  # px right of the colour bar for the key of the non-finite cells


def colour(c) -> tuple[str, float]:
    """``(#rrggbb, opacity)`` for a matplotlib-style colour: a name (``tab:blue``), ``#rrggbb`` or an RGB(A) tuple."""
    if isinstance(c, str):
        if c.startswith("#") and len(c) == 7:
            return c.lower(), 1.0
        if c in _NAMED:
            return _NAMED[c], 1.0
        raise ValueError(f"unknown colour {c!r}: use a tab10 name (tab:blue...), black, white, grey or #rrggbb")
    rgba = tuple(float(v) for v in c)
    if len(rgba) not in (3, 4):
        raise ValueError(f"colour {c!r}: expected 3 or 4 components")
    r, g, b = (min(255, max(0, round(v * 255))) for v in rgba[:3])
    return f"#{r:02x}{g:02x}{b:02x}", rgba[3] if len(rgba) == 4 else 1.0


def cmap(name: str):
    """A matplotlib colour map (``viridis``, ``magma``...): maps values in [0, 1] to RGBA."""
    try:
        from matplotlib import colormaps
    except ImportError:
        raise ImportError("the report's colour maps come from matplotlib: pip install matplotlib") from None
    return colormaps[name]


def text_width(s: str, size: float) -> float:
    return 0.6 * size * len(s)


def _num(v: float) -> str:
    """A coordinate, rounded to 0.1 px (deterministic text, small files)."""
    r = round(float(v), 1)
    return str(int(r)) if r == int(r) else f"{r:.1f}"


def _attr_colour(name: str, c, alpha: float = 1.0) -> str:
    hexc, a = colour(c)
    a *= alpha
    return f'{name}="{hexc}"' + (f' {name}-opacity="{a:.3g}"' if a < 1 else "")


# -- scales and ticks ------------------------------------------------------------------------------------------
@dataclass
class Scale:
    kind: str = "linear"  # linear | log | symlog
    linthresh: float = 1.0

    def f(self, v) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        if self.kind == "log":
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
        if self.kind == "symlog":
            return np.sign(v) * np.log10(1.0 + np.abs(v) / self.linthresh)
        return v

    def inv(self, u: float) -> float:
        if self.kind == "log":
            return 10.0**u
        if self.kind == "symlog":
            return math.copysign(self.linthresh * (10.0 ** abs(u) - 1.0), u)
        return u

    def ticks(self, lo: float, hi: float, integer: bool = False, n: int = 5) -> list[tuple[float, str]]:
        """(value, label) ticks for the data range [lo, hi] (data units), about ``n`` of them."""
        if self.kind == "log":
            return _log_ticks(lo, hi, n + 2)
        if self.kind == "symlog":
            return _symlog_ticks(lo, hi, self.linthresh)
        return _linear_ticks(lo, hi, integer, n)


def _nice_step(span: float, n: int = 5) -> float:
    raw = span / n
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * 0.999)


def _fmt_tick(v: float, step: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:  # scientific, with the digits that tell neighbouring ticks apart
        sig = math.floor(math.log10(abs(v))) - math.floor(math.log10(step) + 1e-9) + 1
        sig += 1 if round(step / 10.0 ** math.floor(math.log10(step) + 1e-9), 6) % 1 else 0
        return f"{v:.{min(15, max(1, sig))}g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    decimals = next((d for d in range(10) if abs(round(step, d) - step) <= 1e-9 * step), 10)  # 2.5 -> 1, 0.25 -> 2
    return f"{v:.{decimals}f}"


def _linear_ticks(lo: float, hi: float, integer: bool, n: int = 5) -> list[tuple[float, str]]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [(lo, _fmt_tick(lo, 1.0))] if math.isfinite(lo) else []
    step = _nice_step(hi - lo, n)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    out = []
    k = 0
    while first + k * step <= hi + 1e-9 * step and k < 50:
        v = first + k * step
        v = 0.0 if abs(v) < 1e-12 * step else v
        out.append((v, _fmt_tick(v, step)))
        k += 1
    return out


def _pow10(k: int) -> str:
    return {-2: "0.01", -1: "0.1", 0: "1", 1: "10", 2: "100", 3: "1000"}.get(k, f"1e{k}")


def _log_ticks(lo: float, hi: float, most: int = 7) -> list[tuple[float, str]]:
    """Powers of ten; where fewer than two lie in [lo, hi], 1-2-5 steps, then 1..9 steps (m * 10^k); for a range
    narrower than that (hi / lo < about 1.5), linear ticks."""
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        return []
    a, b = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    inside = lambda v: lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)  # noqa: E731
    every = max(1, math.ceil((b - a + 1) / most))
    decades = [(10.0**k, _pow10(k)) for k in range(a, b + 1) if k % every == 0 and inside(10.0**k)]
    if len(decades) >= 2:
        return decades
    for mantissas in ((1, 2, 5), range(1, 10)):
        out = [(m * 10.0**k, f"{m * 10.0**k:g}") for k in range(a - 1, b + 1) for m in mantissas if inside(m * 10.0**k)]
        if len(out) >= 2:
            return out
    return _linear_ticks(lo, hi, False, 4)


def _symlog_ticks(lo: float, hi: float, lt: float) -> list[tuple[float, str]]:
    out = [(0.0, "0")] if lo <= 0 <= hi else []
    top = max(abs(lo), abs(hi))
    if top <= 0 or not math.isfinite(top):
        return out
    k0, k1 = math.floor(math.log10(lt)) + 1, math.ceil(math.log10(top))  # linthresh itself would sit on 0
    every = max(1, math.ceil((k1 - k0 + 1) / 6))
    for k in range(k0, k1 + 1):
        if (k - k0) % every:
            continue
        v = 10.0**k
        for s in (1, -1):
            if lo <= s * v <= hi:
                out.append((s * v, ("-" if s < 0 else "") + (f"{v:g}" if -3 <= k <= 3 else f"1e{k}")))
    return sorted(out)


# -- drawing records ---------------------------------------------------------------------------------------------
@dataclass
class _Line:
    x: np.ndarray
    y: np.ndarray
    color: object
    lw: float
    ls: str
    marker: str | None
    ms: float
    alpha: float
    label: str | None
    steps: bool


@dataclass
class _Span:
    x0: float
    x1: float
    color: object
    alpha: float
    label: str | None


@dataclass
class _VLine:
    x: float
    color: object
    ls: str
    lw: float
    label: str | None


@dataclass
class _Rug:
    x: np.ndarray
    color: object
    alpha: float
    label: str | None


@dataclass
class _Bars:
    x: np.ndarray
    h: np.ndarray
    width: float
    color: object
    label: str | None


@dataclass
class _Heat:
    data: np.ndarray
    rows: list[str]
    cols: list[str]
    cmap: str
    label: str
    fmt: str
    vmin: float
    vmax: float


@dataclass
class Axes:
    """One panel. Sizes in px of the plot area (``w`` x ``h``)."""

    w: float = 640.0
    h: float = 300.0
    items: list = field(default_factory=list)
    xscale: Scale = field(default_factory=Scale)
    yscale: Scale = field(default_factory=Scale)
    xlim: tuple[float, float] | None = None
    xticks: list[tuple[float, str]] | None = None
    xtick_rotation: float = 0.0
    integer_x: bool = False
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    grid_axis: str | None = None
    legend_loc: str | None = None  # "outside" (right of the panel) or "inside" (upper right)
    legend_ncol: int = 1
    _cycle: int = 0

    # -- matplotlib-like calls ---------------------------------------------------------------------------------
    def plot(self, x, y, *, color=None, lw: float = 1.3, ls: str = "-", marker: str | None = None, ms: float = 4.0,
             alpha: float = 1.0, label: str | None = None, steps: bool = False) -> None:
        x, y = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
        if x.shape != y.shape:
            raise ValueError(f"plot: x has {x.size} points, y has {y.size}")
        if ls not in _DASH:
            raise ValueError(f"plot: unknown line style {ls!r}; one of {sorted(_DASH)}")
        self.items.append(_Line(x, y, self._next(color), lw, ls, marker, ms, alpha, label, steps))

    def axvspan(self, x0: float, x1: float, *, color, alpha: float = 0.1, label: str | None = None) -> None:
        self.items.append(_Span(float(x0), float(x1), color, alpha, label))

    def axvline(self, x: float, *, color="black", ls: str = "-", lw: float = 1.0, label: str | None = None) -> None:
        self.items.append(_VLine(float(x), color, ls, lw, label))

    def rug(self, x, *, color="black", alpha: float = 0.6, label: str | None = None) -> None:
        """Short vertical marks along the top edge at data positions ``x`` (e.g. representable values)."""
        self.items.append(_Rug(np.asarray(x, dtype=float).ravel(), color, alpha, label))

    def bar(self, x, heights, width: float = 0.8, *, color=None, label: str | None = None) -> None:
        self.items.append(_Bars(np.asarray(x, dtype=float).ravel(), np.nan_to_num(np.asarray(heights, dtype=float).ravel()),
                                float(width), self._next(color), label))

    def heatmap(self, data, rows: list, cols: list, *, label: str, cmap: str = "viridis", fmt: str = "{:.2g}",
                vmin: float | None = None, vmax: float | None = None) -> None:
        """Cells of ``data`` (rows top to bottom), a colour bar labelled ``label``; values written in the cells when
        there are at most 400. Non-finite cells have fixed colours: NaN grey (``NAN_CELL``), +Inf magenta
        (``POS_INF_CELL``), -Inf cyan (``NEG_INF_CELL``); when some cell is infinite a key beside the colour bar
        names the colours of the non-finite values present. The colour range comes from the finite values."""
        data = np.asarray(data, dtype=float)
        if data.shape != (len(rows), len(cols)):
            raise ValueError(f"heatmap: data {data.shape} vs {len(rows)} rows x {len(cols)} cols")
        finite = data[np.isfinite(data)]
        lo = float(vmin) if vmin is not None else (float(finite.min()) if finite.size else 0.0)
        hi = float(vmax) if vmax is not None else (float(finite.max()) if finite.size else 1.0)
        if hi <= lo:
            hi = lo + (abs(lo) or 1.0)
        self.items.append(_Heat(data, [str(r) for r in rows], [str(c) for c in cols], cmap, label, fmt, lo, hi))

    def set_xlim(self, lo: float, hi: float) -> None:
        self.xlim = (float(lo), float(hi))

    def get_xlim(self) -> tuple[float, float]:
        return self.xlim if self.xlim is not None else self._auto("x")

    def set_xticks(self, ticks, labels=None, rotation: float = 0.0) -> None:
        ticks = [float(t) for t in ticks]
        labels = [_fmt_tick(t, 1.0) if float(t).is_integer() else f"{t:g}" for t in ticks] if labels is None else labels
        self.xticks = list(zip(ticks, [str(s) for s in labels]))
        self.xtick_rotation = rotation

    def set_yscale(self, kind: str, linthresh: float = 1.0) -> None:
        self.yscale = self._scale(kind, linthresh)

    def set_title(self, s: str) -> None:
        self.title = s

    def set_xlabel(self, s: str) -> None:
        self.xlabel = s

    def set_ylabel(self, s: str) -> None:
        self.ylabel = s

    def grid(self, axis: str = "both") -> None:
        self.grid_axis = axis

    def legend(self, loc: str = "inside", ncol: int = 1) -> None:
        if loc not in ("inside", "outside"):
            raise ValueError(f"legend loc {loc!r}: 'inside' or 'outside'")
        self.legend_loc, self.legend_ncol = loc, max(1, int(ncol))

    # -- internals -------------------------------------------------------------------------------------------------
    @staticmethod
    def _scale(kind: str, linthresh: float) -> Scale:
        if kind not in ("linear", "log", "symlog"):
            raise ValueError(f"scale {kind!r}: linear, log or symlog")
        if kind == "symlog" and not linthresh > 0:
            raise ValueError("symlog needs linthresh > 0")
        return Scale(kind, float(linthresh))

    def _next(self, color):
        if color is not None:
            return color
        c = TAB10[self._cycle % len(TAB10)]
        self._cycle += 1
        return c

    def _heat(self) -> _Heat | None:
        return next((i for i in self.items if isinstance(i, _Heat)), None)

    def _auto(self, axis: str) -> tuple[float, float]:
        sc = self.xscale if axis == "x" else self.yscale
        vals = []
        for it in self.items:
            if isinstance(it, _Line):
                vals.append(it.x if axis == "x" else it.y)
            elif isinstance(it, _Bars):
                vals.append(np.concatenate([it.x - it.width / 2, it.x + it.width / 2]) if axis == "x"
                            else np.concatenate([it.h, [0.0]]))
        u = sc.f(np.concatenate(vals)) if vals else np.array([])
        u = u[np.isfinite(u)]
        if not u.size:
            return (1.0, 10.0) if sc.kind == "log" else (0.0, 1.0)
        lo, hi = float(u.min()), float(u.max())
        pad = 0.04 * (hi - lo) if hi > lo else (0.5 if sc.kind != "linear" else max(abs(lo) * 0.05, 0.5))
        if any(isinstance(i, _Bars) for i in self.items) and axis == "y" and lo >= 0:
            low = sc.inv(0.0) if sc.kind != "log" else sc.inv(lo - pad)  # bars stand on 0
            return low, sc.inv(hi + pad)
        return sc.inv(lo - pad), sc.inv(hi + pad)

    def _limits(self) -> tuple[tuple[float, float], tuple[float, float]]:
        xl = self.xlim if self.xlim is not None else self._auto("x")
        yl = self._auto("y")
        return xl, yl

    def _yticks(self, yl) -> list[tuple[float, str]]:
        return self.yscale.ticks(*sorted(yl), n=max(3, round(self.h / 55)))

    def _xtick_list(self, xl) -> list[tuple[float, str]]:
        if self.xticks is not None:
            return [(v, s) for v, s in self.xticks if min(xl) - 1e-9 <= v <= max(xl) + 1e-9]
        return self.xscale.ticks(*sorted(xl), integer=self.integer_x, n=max(3, round(self.w / 90)))

    def _legend_entries(self) -> list:
        return [i for i in self.items if getattr(i, "label", None)]

    def _legend_cols(self) -> int:
        """The legend's columns: as asked, or more when one column would be taller than the panel."""
        n = len(self._legend_entries())
        return max(self.legend_ncol, math.ceil(n * 15 / max(self.h - 8, 15)))

    def _legend_size(self) -> tuple[float, float]:
        entries = self._legend_entries()
        if not entries or self.legend_loc is None:
            return 0.0, 0.0
        ncol = self._legend_cols()
        per_col = math.ceil(len(entries) / ncol)
        colw = max(text_width(e.label, _TICK_FS) for e in entries) + 34
        return ncol * colw + 8, per_col * 15 + 8

    def margins(self) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) px around the plot area."""
        heat = self._heat()
        if heat is not None:
            ylabels = _thin(heat.rows)
            xlabels = _thin(heat.cols)
            left = max((text_width(s, _TICK_FS) for s in ylabels if s), default=0) + 14
            rot = max((text_width(s, _TICK_FS) for s in xlabels), default=0) * 0.72 + 16
            cw = self.w / max(len(xlabels), 1)  # labels rotated 45 degrees reach left of their cell
            reach = max((text_width(s, _TICK_FS) * 0.72 - (j + 0.5) * cw for j, s in enumerate(xlabels)), default=0)
            right = 65 + max((text_width(s, _TICK_FS) for _, s in _linear_ticks(heat.vmin, heat.vmax, False)), default=0)
            right += _KEY_W if _heat_key(heat.data) else 0
        else:
            xl, yl = self._limits()
            left = max((text_width(s, _TICK_FS) for _, s in self._yticks(yl)), default=10) + 14
            ticks = self._xtick_list(xl)
            rot = (max((text_width(s, _TICK_FS) for _, s in ticks), default=0) * (0.72 if self.xtick_rotation else 0)
                   + 22)
            reach = 0.0
            if self.xtick_rotation:  # rotated labels reach left of their tick
                u0, u1 = (float(self.xscale.f(v)) for v in xl)
                reach = max((text_width(s, _TICK_FS) * 0.72 - (float(self.xscale.f(v)) - u0) / ((u1 - u0) or 1) * self.w
                             for v, s in ticks), default=0.0)
            right = 14 + (self._legend_size()[0] + 8 if self.legend_loc == "outside" else 0)
        left += 20 if self.ylabel else 0
        left = max(left, reach + 6)
        bottom = rot + (20 if self.xlabel else 0)
        top = 10 + 16 * (self.title.count("\n") + 1 if self.title else 0)
        if self.title:  # a title wider than the panel: room on both sides
            half = max(text_width(line, _LABEL_FS) for line in self.title.split("\n")) / 2 - self.w / 2 + 4
            left, right = max(left, half), max(right, half)
        return left, top, right, bottom


def _thin(labels: list[str], most: int = 60) -> list[str]:
    """Every k-th label (others blank) when there are more than ``most``."""
    k = max(1, math.ceil(len(labels) / most))
    return [s if i % k == 0 else "" for i, s in enumerate(labels)]


# -- rendering ---------------------------------------------------------------------------------------------------
class _Writer:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x: float, y: float, s: str, *, size: float = _TICK_FS, anchor: str = "middle", rotate: float = 0.0,
             weight: str | None = None, fill: str = "#222222") -> None:
        tr = f' transform="rotate({_num(rotate)} {_num(x)} {_num(y)})"' if rotate else ""
        w = f' font-weight="{weight}"' if weight else ""
        self.add(f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size:g}" text-anchor="{anchor}" fill="{fill}"{w}{tr}>'
                 f"{escape(s)}</text>")


def _path(px: np.ndarray, py: np.ndarray) -> str:
    """An SVG path through the points, broken at NaN."""
    ok = np.isfinite(px) & np.isfinite(py)
    out, pen = [], False
    for a, b, good in zip(px.tolist(), py.tolist(), ok.tolist()):
        if not good:
            pen = False
            continue
        out.append(f"{'L' if pen else 'M'}{_num(a)} {_num(b)}")
        pen = True
    return "".join(out)


def _steps_mid(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if x.size < 2:
        return x, y
    mid = (x[1:] + x[:-1]) / 2
    edges = np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])
    return np.repeat(edges, 2)[1:-1], np.repeat(y, 2)


def _draw_axes(w: _Writer, ax: Axes, ox: float, oy: float, clip_id: str) -> None:
    """Render ``ax`` with its plot area's top-left corner at (ox, oy)."""
    heat = ax._heat()
    if heat is not None:
        _draw_heat(w, ax, heat, ox, oy, clip_id)
        return
    (x0, x1), (y0, y1) = ax._limits()
    fx, fy = ax.xscale.f, ax.yscale.f
    ux0, ux1 = float(fx(x0)), float(fx(x1))
    uy0, uy1 = float(fy(y0)), float(fy(y1))
    ux1 = ux1 if ux1 != ux0 else ux0 + 1
    uy1 = uy1 if uy1 != uy0 else uy0 + 1

    def X(v):
        return ox + (fx(v) - ux0) / (ux1 - ux0) * ax.w

    def Y(v):
        return oy + ax.h - (fy(v) - uy0) / (uy1 - uy0) * ax.h

    w.add(f'<rect x="{_num(ox)}" y="{_num(oy)}" width="{_num(ax.w)}" height="{_num(ax.h)}" fill="white"/>')
    xt, yt = ax._xtick_list((x0, x1)), ax._yticks((y0, y1))
    if ax.grid_axis:
        g = []
        if ax.grid_axis in ("both", "x"):
            g += [f"M{_num(X(v))} {_num(oy)}V{_num(oy + ax.h)}" for v, _ in xt]
        if ax.grid_axis in ("both", "y"):
            g += [f"M{_num(ox)} {_num(Y(v))}H{_num(ox + ax.w)}" for v, _ in yt]
        w.add(f'<path d="{"".join(g)}" stroke="#b0b0b0" stroke-opacity="0.5" stroke-width="0.8" fill="none"/>')
    w.add(f'<g clip-path="url(#{clip_id})">')
    for it in ax.items:
        if isinstance(it, _Span):
            a, b = sorted((float(X(it.x0)), float(X(it.x1))))
            a, b = max(a, ox - 1), min(b, ox + ax.w + 1)
            if b > a:
                w.add(f'<rect x="{_num(a)}" y="{_num(oy)}" width="{_num(b - a)}" height="{_num(ax.h)}" '
                      f'{_attr_colour("fill", it.color, it.alpha)}/>')
    for it in ax.items:
        if isinstance(it, _Bars):
            for xv, hv in zip(it.x.tolist(), it.h.tolist()):
                a, b = float(X(xv - it.width / 2)), float(X(xv + it.width / 2))
                base = y0 if ax.yscale.kind == "log" else 0.0
                top, bot = sorted((float(Y(hv)), float(Y(base))))
                if math.isfinite(top) and math.isfinite(bot) and bot > top:
                    w.add(f'<rect x="{_num(a)}" y="{_num(top)}" width="{_num(b - a)}" height="{_num(bot - top)}" '
                          f'{_attr_colour("fill", it.color)}/>')
        elif isinstance(it, _Line):
            x, y = (_steps_mid(it.x, it.y) if it.steps else (it.x, it.y))
            px, py = X(x), Y(y)
            if it.ls is not None and it.lw > 0:
                d = _path(px, py)
                if d:
                    dash = _DASH[it.ls]
                    w.add(f'<path d="{d}" fill="none" {_attr_colour("stroke", it.color, it.alpha)} '
                          f'stroke-width="{it.lw:g}" stroke-linejoin="round"' + (f' stroke-dasharray="{dash}"' if dash else "")
                          + "/>")
            if it.marker:
                mx, my = X(it.x), Y(it.y)
                w.add(_markers(mx, my, it.marker, it.ms, it.color, it.alpha))
        elif isinstance(it, _VLine):
            px = float(X(it.x))
            dash = _DASH[it.ls]
            w.add(f'<path d="M{_num(px)} {_num(oy)}V{_num(oy + ax.h)}" {_attr_colour("stroke", it.color)} '
                  f'stroke-width="{it.lw:g}"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        elif isinstance(it, _Rug):
            px = X(it.x)
            d = "".join(f"M{_num(v)} {_num(oy)}v9" for v in px[np.isfinite(px)].tolist())
            if d:
                w.add(f'<path d="{d}" {_attr_colour("stroke", it.color, it.alpha)} stroke-width="0.8"/>')
    w.add("</g>")
    w.add(f'<rect x="{_num(ox)}" y="{_num(oy)}" width="{_num(ax.w)}" height="{_num(ax.h)}" fill="none" stroke="#444444" '
          f'stroke-width="0.8"/>')
    ticks = "".join(f"M{_num(X(v))} {_num(oy + ax.h)}v4" for v, _ in xt) + "".join(
        f"M{_num(ox)} {_num(Y(v))}h-4" for v, _ in yt)
    w.add(f'<path d="{ticks}" stroke="#444444" stroke-width="0.8"/>')
    for v, s in xt:
        if ax.xtick_rotation:
            w.text(float(X(v)) + 3, oy + ax.h + 12, s, anchor="end", rotate=-ax.xtick_rotation)
        else:
            w.text(float(X(v)), oy + ax.h + 16, s)
    for v, s in yt:
        w.text(ox - 7, float(Y(v)) + 3.5, s, anchor="end")
    _labels(w, ax, ox, oy)
    _legend(w, ax, ox, oy)


def _markers(mx: np.ndarray, my: np.ndarray, marker: str, ms: float, color, alpha: float) -> str:
    ok = np.isfinite(mx) & np.isfinite(my)
    r = ms / 2
    if marker == "o":
        d = "".join(f"M{_num(a - r)} {_num(b)}a{r:g} {r:g} 0 1 0 {2 * r:g} 0a{r:g} {r:g} 0 1 0 {-2 * r:g} 0"
                    for a, b in zip(mx[ok].tolist(), my[ok].tolist()))
        return f'<path d="{d}" {_attr_colour("fill", color, alpha)}/>'
    if marker in ("x", "+"):
        if marker == "x":
            d = "".join(f"M{_num(a - r)} {_num(b - r)}l{ms:g} {ms:g}m0 {-ms:g}l{-ms:g} {ms:g}"
                        for a, b in zip(mx[ok].tolist(), my[ok].tolist()))
        else:
            d = "".join(f"M{_num(a - r)} {_num(b)}h{ms:g}m{-r:g} {-r:g}v{ms:g}" for a, b in zip(mx[ok].tolist(), my[ok].tolist()))
        return f'<path d="{d}" {_attr_colour("stroke", color, alpha)} stroke-width="1.2" fill="none"/>'
    raise ValueError(f"unknown marker {marker!r}: 'o', 'x' or '+'")


def _labels(w: _Writer, ax: Axes, ox: float, oy: float) -> None:
    left, top, _, bottom = ax.margins()
    if ax.title:
        lines = ax.title.split("\n")
        for i, line in enumerate(lines):
            w.text(ox + ax.w / 2, oy - 8 - 15 * (len(lines) - 1 - i), line, size=_LABEL_FS, weight="bold")
    if ax.xlabel:
        w.text(ox + ax.w / 2, oy + ax.h + bottom - 6, ax.xlabel, size=_LABEL_FS)
    if ax.ylabel:
        w.text(ox - left + 13, oy + ax.h / 2, ax.ylabel, size=_LABEL_FS, rotate=-90)


def _legend(w: _Writer, ax: Axes, ox: float, oy: float) -> None:
    entries = ax._legend_entries()
    if not entries or ax.legend_loc is None:
        return
    lw, lh = ax._legend_size()
    if ax.legend_loc == "outside":
        lx, ly = ox + ax.w + 12, oy
    else:
        lx, ly = ox + ax.w - lw - 6, oy + 6
    w.add(f'<rect x="{_num(lx)}" y="{_num(ly)}" width="{_num(lw)}" height="{_num(lh)}" fill="white" fill-opacity="0.85" '
          f'stroke="#cccccc" stroke-width="0.8"/>')
    ncol = ax._legend_cols()
    per_col = math.ceil(len(entries) / ncol)
    colw = (lw - 8) / ncol
    for i, e in enumerate(entries):
        cx = lx + 6 + (i // per_col) * colw
        cy = ly + 4 + (i % per_col) * 15 + 7.5
        if isinstance(e, (_Span, _Bars)):
            alpha = e.alpha if isinstance(e, _Span) else 1.0
            w.add(f'<rect x="{_num(cx)}" y="{_num(cy - 5)}" width="20" height="10" '
                  f'{_attr_colour("fill", e.color, min(1.0, alpha * (3 if isinstance(e, _Span) else 1)))}/>')
        elif isinstance(e, _Rug):
            w.add(f'<path d="M{_num(cx + 10)} {_num(cy - 5)}v10" {_attr_colour("stroke", e.color, e.alpha)} '
                  f'stroke-width="1"/>')
        else:
            ls = e.ls if isinstance(e, (_Line, _VLine)) else "-"
            dash = _DASH.get(ls)
            lwid = e.lw if isinstance(e, (_Line, _VLine)) else 1.0
            if lwid > 0:
                w.add(f'<path d="M{_num(cx)} {_num(cy)}h20" {_attr_colour("stroke", e.color)} stroke-width="{max(lwid, 1):g}"'
                      + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
            if isinstance(e, _Line) and e.marker:
                w.add(_markers(np.array([cx + 10]), np.array([cy]), e.marker, e.ms, e.color, e.alpha))
        w.text(cx + 26, cy + 3.5, e.label, anchor="start")


def _cell_fill(v: float, rgba) -> str:
    if np.isnan(v):
        return NAN_CELL
    if np.isinf(v):
        return POS_INF_CELL if v > 0 else NEG_INF_CELL
    return colour(tuple(rgba))[0]


def _heat_key(data: np.ndarray) -> list[tuple[str, str]]:
    """(label, colour) of the non-finite values in ``data`` when some are infinite (else none: NaN alone is the
    grey of empty cells, which needs no key)."""
    key = [(label, c) for label, c, present in (("+Inf", POS_INF_CELL, np.isposinf(data).any()),
                                                ("-Inf", NEG_INF_CELL, np.isneginf(data).any())) if present]
    if key and np.isnan(data).any():
        key.append(("NaN", NAN_CELL))
    return key


def _draw_heat(w: _Writer, ax: Axes, heat: _Heat, ox: float, oy: float, clip_id: str) -> None:
    nr, nc = heat.data.shape
    cw, ch = ax.w / max(nc, 1), ax.h / max(nr, 1)
    cm = cmap(heat.cmap)
    norm = np.clip((heat.data - heat.vmin) / (heat.vmax - heat.vmin), 0.0, 1.0)
    rgba = cm(np.nan_to_num(norm))
    annotate = heat.data.size <= 400
    lum = (rgba[..., :3] * np.array([0.299, 0.587, 0.114])).sum(axis=-1)
    for i in range(nr):
        for j in range(nc):
            v = heat.data[i, j]
            fill = _cell_fill(v, rgba[i, j])
            x, y = ox + j * cw, oy + i * ch
            w.add(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(cw + 0.3)}" height="{_num(ch + 0.3)}" fill="{fill}"/>')
            if annotate and np.isfinite(v) and ch >= 9:
                w.text(x + cw / 2, y + ch / 2 + 3.5, heat.fmt.format(v), size=min(9.0, ch * 0.75),
                       fill="#000000" if lum[i, j] > 0.5 else "#ffffff")
    w.add(f'<rect x="{_num(ox)}" y="{_num(oy)}" width="{_num(ax.w)}" height="{_num(ax.h)}" fill="none" stroke="#444444" '
          f'stroke-width="0.8"/>')
    for i, s in enumerate(_thin(heat.rows)):
        if s:
            w.text(ox - 6, oy + (i + 0.5) * ch + 3.5, s, anchor="end")
    for j, s in enumerate(_thin(heat.cols)):
        if s:
            w.text(ox + (j + 0.5) * cw + 3, oy + ax.h + 10, s, anchor="end", rotate=-45)
    # colour bar
    bx, bw = ox + ax.w + 16, 14
    stops = "".join(f'<stop offset="{k / 10:g}" stop-color="{colour(tuple(cm(1 - k / 10)))[0]}"/>' for k in range(11))
    w.add(f'<defs><linearGradient id="{clip_id}-cb" x1="0" y1="0" x2="0" y2="1">{stops}</linearGradient></defs>')
    w.add(f'<rect x="{_num(bx)}" y="{_num(oy)}" width="{bw}" height="{_num(ax.h)}" fill="url(#{clip_id}-cb)" '
          f'stroke="#444444" stroke-width="0.8"/>')
    for v, s in _linear_ticks(heat.vmin, heat.vmax, False):
        y = oy + ax.h - (v - heat.vmin) / (heat.vmax - heat.vmin) * ax.h
        w.add(f'<path d="M{_num(bx + bw)} {_num(y)}h4" stroke="#444444" stroke-width="0.8"/>')
        w.text(bx + bw + 7, y + 3.5, s, anchor="start")
    key = _heat_key(heat.data)
    right = ax.margins()[2] - (_KEY_W if key else 0)
    w.text(ox + ax.w + right - 8, oy + ax.h / 2, heat.label, size=_TICK_FS, rotate=-90)
    kx = ox + ax.w + right + 4
    for k, (label, fill) in enumerate(key):  # the non-finite values' colours, beside the colour bar
        ky = oy + 15 * k
        w.add(f'<rect x="{_num(kx)}" y="{_num(ky)}" width="10" height="10" fill="{fill}" stroke="#444444" '
              f'stroke-width="0.5"/>')
        w.text(kx + 14, ky + 9, label, anchor="start")
    _labels(w, ax, ox, oy)


class Figure:
    """A grid of ``Axes``; ``save(path)`` writes the SVG."""

    def __init__(self, nrows: int = 1, ncols: int = 1, *, panel: tuple[float, float] = (640, 300),
                 title: str = "", sharex: bool = False):
        if nrows < 1 or ncols < 1:
            raise ValueError("a figure needs at least one row and one column")
        self.title = title
        self.sharex = sharex
        self.axes = [[Axes(float(panel[0]), float(panel[1])) for _ in range(ncols)] for _ in range(nrows)]

    def to_svg(self) -> str:
        grid = self.axes
        if self.sharex:  # one x range for every panel of a column
            for j in range(len(grid[0])):
                col = [row[j] for row in grid]
                lims = [a.get_xlim() for a in col]
                lim = (min(lo for lo, _ in lims), max(hi for _, hi in lims))
                for a in col:
                    a.xlim = lim
        m = [[a.margins() for a in row] for row in grid]
        rows, cols = range(len(grid)), range(len(grid[0]))
        # plot areas line up: one left/right margin per column, one top/bottom margin per row
        left = [max(m[i][j][0] for i in rows) for j in cols]
        right = [max(m[i][j][2] for i in rows) for j in cols]
        top = [max(m[i][j][1] for j in cols) for i in rows]
        bottom = [max(m[i][j][3] for j in cols) for i in rows]
        colw = [left[j] + max(grid[i][j].w for i in rows) + right[j] for j in cols]
        rowh = [top[i] + max(grid[i][j].h for j in cols) + bottom[i] for i in rows]
        head = 30.0 if self.title else 4.0
        width, height = sum(colw) + 8, sum(rowh) + head + 4
        w = _Writer()
        w.add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" height="{_num(height)}" '
              f'viewBox="0 0 {_num(width)} {_num(height)}" font-family="{FONT}">')
        w.add(f'<rect width="{_num(width)}" height="{_num(height)}" fill="white"/>')
        if self.title:
            w.text(width / 2, 20, self.title, size=_TITLE_FS + 1, weight="bold")
        clips = []
        y = head
        for i, row in enumerate(grid):
            x = 4.0
            for j, ax in enumerate(row):
                ox, oy = x + left[j], y + top[i]
                cid = f"p{i}_{j}"
                clips.append(f'<clipPath id="{cid}"><rect x="{_num(ox)}" y="{_num(oy)}" width="{_num(ax.w)}" '
                             f'height="{_num(ax.h)}"/></clipPath>')
                _draw_axes(w, ax, ox, oy, cid)
                x += colw[j]
            y += rowh[i]
        w.parts.insert(2, "<defs>" + "".join(clips) + "</defs>")
        w.add("</svg>\n")
        return "\n".join(w.parts)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_svg(), encoding="utf-8")


def subplots(nrows: int = 1, ncols: int = 1, **kw) -> tuple[Figure, object]:
    """``(fig, ax)`` for one panel, ``(fig, [[ax...]...])`` -> numpy object array like matplotlib for several."""
    fig = Figure(nrows, ncols, **kw)
    if nrows == ncols == 1:
        return fig, fig.axes[0][0]
    arr = np.empty((nrows, ncols), dtype=object)
    for i in range(nrows):
        for j in range(ncols):
            arr[i, j] = fig.axes[i][j]
    return fig, arr[0] if nrows == 1 else (arr[:, 0] if ncols == 1 else arr)


__all__ = ["Axes", "Figure", "Scale", "TAB10", "cmap", "colour", "subplots", "text_width"]
