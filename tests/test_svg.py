"""fxquant.analysis.svg: the report's figure writer. Ticks are laws (inside the range, evenly spaced, distinct
labels), the output is well-formed, deterministic SVG, and what the figure holds (lines broken at NaN, grey NaN
cells, legends, colour bars) is in the file."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant.analysis import svg

NS = "{http://www.w3.org/2000/svg}"
finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)


def parse(fig: svg.Figure) -> ET.Element:
    return ET.fromstring(fig.to_svg())


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{NS}text")]


@settings(max_examples=300, deadline=None)
@given(finite, finite, st.integers(3, 12))
def test_linear_ticks_lie_in_range_evenly_spaced_with_distinct_labels(a, b, n):
    lo, hi = min(a, b), max(a, b)
    if hi - lo < 1e-6 * max(abs(lo), abs(hi), 1.0):
        return
    ticks = svg.Scale().ticks(lo, hi, n=n)
    vals = [v for v, _ in ticks]
    assert 1 <= len(ticks) <= 3 * n + 2
    span = hi - lo
    assert all(lo - 1e-9 * span <= v <= hi + 1e-9 * span for v in vals)
    if len(vals) > 2:
        steps = np.diff(vals)
        assert np.allclose(steps, steps[0], rtol=1e-6, atol=1e-9 * span)
    assert len({s for _, s in ticks}) == len(ticks)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-30, 1e30), st.floats(1e-30, 1e30))
def test_log_ticks_are_powers_of_ten_or_1_2_5_inside_the_range(a, b):
    lo, hi = min(a, b), max(a, b)
    if hi <= lo * (1 + 1e-6):
        return
    ticks = svg.Scale("log").ticks(lo, hi)
    for v, _ in ticks:
        assert lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)
        if hi >= 10 * lo:  # a decade or more: powers of ten, or 1-2-5 steps
            mant = v / 10.0 ** math.floor(math.log10(v) + 1e-12)
            assert min(abs(mant - m) for m in (1, 2, 5)) < 1e-6
    if hi >= 1.2 * lo:  # an axis spanning less than a decade had no labels at all (2..8, 0.0195..0.06)
        assert len(ticks) >= 2, (lo, hi, ticks)
    if hi / lo >= 100:  # two whole decades: at least one power of ten is labelled
        assert ticks


def test_tick_labels_keep_the_digits_of_the_step():
    assert [s for _, s in svg.Scale().ticks(0.0, 10.0, n=4)] == ["0", "2.5", "5.0", "7.5", "10.0"]
    assert [s for _, s in svg.Scale().ticks(0.0, 1.0, n=4)] == ["0", "0.25", "0.50", "0.75", "1.00"]
    assert [s for _, s in svg.Scale().ticks(0.0, 40.0, n=4)] == ["0", "10", "20", "30", "40"]


def test_symlog_ticks_and_transform():
    sc = svg.Scale("symlog", 1e-3)
    vals = [v for v, _ in sc.ticks(0.0, 40.0)]
    assert vals[0] == 0.0 and 1e-3 not in vals and 10.0 in vals
    assert sc.f([0.0])[0] == 0.0 and sc.inv(float(sc.f([5.0])[0])) == pytest.approx(5.0)
    assert sc.f([-5.0])[0] == -sc.f([5.0])[0]


def test_colours_and_bad_arguments():
    assert svg.colour("tab:blue") == ("#1f77b4", 1.0)
    assert svg.colour((1.0, 0.0, 0.0, 0.5)) == ("#ff0000", 0.5)
    assert svg.colour("#ABCDEF") == ("#abcdef", 1.0)
    with pytest.raises(ValueError, match="unknown colour"):
        svg.colour("blurple")
    fig, ax = svg.subplots()
    with pytest.raises(ValueError, match="line style"):
        ax.plot([0, 1], [0, 1], ls="~")
    with pytest.raises(ValueError, match="points"):
        ax.plot([0, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="scale"):
        ax.set_yscale("logit")
    with pytest.raises(ValueError, match="heatmap"):
        ax.heatmap(np.zeros((2, 3)), ["a", "b"], ["x"], label="v")
    ax.plot([0, 1], [0, 1], marker="*")
    with pytest.raises(ValueError, match="marker"):
        fig.to_svg()


def _line_figure(y) -> svg.Figure:
    fig, ax = svg.subplots(panel=(300, 200), title="t")
    ax.plot(np.arange(len(y)), y, label="series a")
    ax.axvspan(1, 2, color="tab:red", alpha=0.1, label="span")
    ax.axvline(3, ls="--", label="limit")
    ax.rug([0.5, 1.5], label="marks")
    ax.set_xlabel("x label")
    ax.set_ylabel("y label")
    ax.legend("outside")
    ax.grid()
    return fig


def test_line_figure_is_well_formed_deterministic_and_breaks_at_nan():
    y = [1.0, 2.0, np.nan, 3.0, 4.0, 5.0]
    a, b = _line_figure(y).to_svg(), _line_figure(y).to_svg()
    assert a == b  # same bytes for the same data
    root = ET.fromstring(a)
    assert root.tag == f"{NS}svg" and float(root.get("width")) > 300 and float(root.get("height")) > 200
    clipped = [g for g in root.iter(f"{NS}g") if g.get("clip-path")]
    (data,) = clipped
    line = next(p for p in data.iter(f"{NS}path") if p.get("stroke") == svg.TAB10[0])
    assert line.get("d").count("M") == 2  # two pieces around the NaN
    t = texts(root)
    for s in ("t", "x label", "y label", "series a", "span", "limit", "marks"):
        assert s in t


def test_every_text_anchor_lies_inside_the_figure():
    fig, ax = svg.subplots(panel=(200, 150))
    ax.bar([0, 1, 2], [5.0, 0.0, 1e-2], 0.4, label="long legend entry for the bars")
    ax.set_xticks([0, 1, 2], ["a very long category name", "b", "c"], rotation=30)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title("a title much wider than the two hundred pixel panel it sits above")
    ax.legend("outside")
    root = parse(fig)
    w, h = float(root.get("width")), float(root.get("height"))
    for t in root.iter(f"{NS}text"):
        x, y = float(t.get("x")), float(t.get("y"))
        assert 0 <= x <= w and 0 <= y <= h, "".join(t.itertext())
        width = svg.text_width("".join(t.itertext()), float(t.get("font-size")))
        if t.get("text-anchor") == "middle" and not t.get("transform"):
            assert x - width / 2 >= -1 and x + width / 2 <= w + 1
        if t.get("transform"):  # rotated tick labels: their far end (upper-left) stays inside too
            assert x - 0.87 * width >= -1


def test_heatmap_cells_nan_grey_annotations_and_colour_bar():
    data = np.array([[0.0, 1.0, np.nan], [2.0, 3.0, 4.0]])
    fig, ax = svg.subplots(panel=(240, 120))
    ax.heatmap(data, ["L0", "L1"], ["a", "b", "c"], label="metric", cmap="magma", vmin=0.0)
    root = parse(fig)
    rects = [r for r in root.iter(f"{NS}rect") if r.get("fill", "").startswith("#")]
    fills = [r.get("fill") for r in rects]
    assert fills.count(svg.NAN_CELL) == 1
    cm = svg.cmap("magma")
    assert svg.colour(tuple(cm(1.0)))[0] in fills and svg.colour(tuple(cm(0.0)))[0] in fills  # 4.0 and 0.0
    t = texts(root)
    assert [s for s in t if s in ("0", "1", "2", "3", "4")].count("4") >= 1 and "metric" in t
    assert {"L0", "L1", "a", "b", "c"} <= set(t)
    assert any(g.tag == f"{NS}linearGradient" for g in root.iter())



def test_heatmap_infinities_have_their_own_colours_and_a_key():
    """+Inf and -Inf cells are drawn in fixed colours of their own, distinct from NaN's grey and from every colour
    of the map (so not the map's saturated ends, which large finite values take), and a key beside the colour bar
    names the non-finite colours present; a heatmap without infinities has no key."""
    data = np.array([[np.inf, np.nan, -np.inf, 1.0], [-1.0, 0.5, 0.0, -0.5]])
    fig, ax = svg.subplots(panel=(240, 120))
    ax.heatmap(data, ["r0", "r1"], list("abcd"), label="value", cmap="RdBu_r", vmin=-1.0, vmax=1.0)
    root = parse(fig)
    cells = [r.get("fill") for r in root.iter(f"{NS}rect") if r.get("fill", "").startswith("#")
             and r.get("width") != "10"][:8]
    cm = svg.cmap("RdBu_r")
    assert cells[:3] == [svg.POS_INF_CELL, svg.NAN_CELL, svg.NEG_INF_CELL]
    assert len({svg.POS_INF_CELL, svg.NEG_INF_CELL, svg.NAN_CELL}) == 3
    for name in ("RdBu_r", "viridis", "magma"):  # the report's colour maps
        ramp = {svg.colour(tuple(svg.cmap(name)(k / 255)))[0] for k in range(256)}
        assert not {svg.POS_INF_CELL, svg.NEG_INF_CELL} & ramp, name
    assert cells[3] == svg.colour(tuple(cm(1.0)))[0] and cells[4] == svg.colour(tuple(cm(0.0)))[0]
    key = [r.get("fill") for r in root.iter(f"{NS}rect") if r.get("width") == "10"]
    assert key == [svg.POS_INF_CELL, svg.NEG_INF_CELL, svg.NAN_CELL]
    t = texts(root)
    assert t.index("+Inf") < t.index("-Inf") < t.index("NaN")
    width = float(root.get("width"))
    assert all(float(r.get("x")) + 40 <= width for r in root.iter(f"{NS}rect") if r.get("width") == "10")

    fig, ax = svg.subplots(panel=(240, 120))
    ax.heatmap(np.array([[np.nan, 1.0]]), ["r"], ["a", "b"], label="value")
    root = parse(fig)
    assert not [r for r in root.iter(f"{NS}rect") if r.get("width") == "10"] and "NaN" not in texts(root)

def test_many_layers_thin_labels_and_legend_wraps_into_columns():
    rows = [str(i) for i in range(150)]
    fig, ax = svg.subplots(panel=(100, 600))
    ax.heatmap(np.arange(150.0).reshape(150, 1), rows, ["x"], label="v")
    t = texts(parse(fig))
    assert "0" in t and "3" in t and "1" not in t and 50 <= sum(s.isdigit() for s in t) <= 58  # every 3rd + bar ticks
    fig, ax = svg.subplots(panel=(300, 100))
    for i in range(20):
        ax.plot([0, 1], [i, i + 1], label=f"layer {i}")
    ax.legend("outside")
    assert ax._legend_cols() >= 3 and ax._legend_size()[1] <= ax.h + 15
