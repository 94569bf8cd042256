"""The report's charts: matplotlib figures (no pyplot: no global state, safe in the trainer's thread) written as
SVG text to inline in the page, so the page needs no file and makes no request.

    chart = line_chart("reward", "Reward", [Series("reward_mean", "train reward", steps, values)], "reward")
    chart.svg                         # "<svg ...>...</svg>" (no XML prolog: it sits inside HTML)

Every series is one SVG group with the id "<chart id>--<series key>" (matplotlib writes an artist's gid as the id
of its group), holding its line and, up to MAX_MARKERS points, one marker (`<use>`) per data point: what the
browser test counts against metrics.jsonl. Ids of the markers and clip paths are salted with the chart id
(svg.hashsalt) and matplotlib's numbered group ids are prefixed with it, so charts inlined in one page never share
an id.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MAX_MARKERS", "Chart", "Series", "bar_chart", "histogram_chart", "line_chart"]

MAX_MARKERS = 400  # series with more points are drawn as a line only (a marker per point would bloat the page)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
_AUTO_ID = re.compile(r' id="([A-Za-z][\w.]*_\d+)"')
_RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7,
       "font.family": "sans-serif", "axes.spines.top": False, "axes.spines.right": False}


@dataclass(frozen=True)
class Series:
    key: str  # identifies the series in the SVG (the group id's suffix)
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: str = "-"  # matplotlib's line style: "-", "--", ":"
    color: str | None = None
    band: tuple[Sequence[float], Sequence[float]] | None = None  # (lo, hi) per point: an interval drawn as a band


@dataclass
class Chart:
    id: str
    title: str
    svg: str
    points: dict[str, int] = field(default_factory=dict)  # series key -> data points drawn
    note: str = ""


def _ok(y: float | None) -> bool:
    return y is not None and math.isfinite(y)


def _svg(fig, chart_id: str) -> str:  # noqa: ANN001 (a matplotlib Figure)
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": chart_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # the prolog and DOCTYPE name a DTD: not for inline SVG
    # matplotlib numbers its groups per figure (figure_1, axes_1, line2d_1...): prefix them, one page holds many
    return _AUTO_ID.sub(lambda m: f' id="{chart_id}-{m.group(1)}"', text)


def _figure(size: tuple[float, float]):  # noqa: ANN202
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def line_chart(chart_id: str, title: str, series: Sequence[Series], ylabel: str, *, xlabel: str = "step",
               logy: bool = False, ylim: tuple[float, float] | None = None, note: str = "",
               size: tuple[float, float] = (6.0, 2.7)) -> Chart | None:
    """One chart of several series; None when no series has a finite point."""
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    drawn = []
    for s in series:  # the finite points (> 0 on a log axis)
        keep = [j for j, y in enumerate(s.ys) if _ok(y) and (not logy or y > 0)]
        if keep:
            drawn.append((s, keep))
    if not drawn:
        return None
    points: dict[str, int] = {}
    with matplotlib.rc_context(_RC):
        fig = _figure(size)
        ax = fig.subplots()
        for i, (s, keep) in enumerate(drawn):
            xs, ys = [s.xs[j] for j in keep], [s.ys[j] for j in keep]
            color = s.color or COLORS[i % len(COLORS)]
            marker = "o" if len(xs) <= MAX_MARKERS else None
            (line,) = ax.plot(xs, ys, linestyle=s.style, marker=marker, markersize=2.5, linewidth=1.2,
                              color=color, label=s.label or "_nolegend_")  # "": not in the legend
            line.set_gid(f"{chart_id}--{s.key}")
            points[s.key] = len(xs)
            if s.band is not None:
                lo, hi = s.band
                both = [j for j in keep if _ok(lo[j]) and _ok(hi[j]) and (not logy or lo[j] > 0)]
                if both:
                    ax.fill_between([s.xs[j] for j in both], [lo[j] for j in both], [hi[j] for j in both],
                                    color=color, alpha=0.15, linewidth=0)
        if logy:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, bins
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.25)
        # beside the axes, where it hides no line
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)
        return Chart(chart_id, title, _svg(fig, chart_id), points, note)


def histogram_chart(chart_id: str, title: str, edges: Sequence[float], hists: Sequence[tuple[str, Sequence[int], int]],
                    note: str = "") -> Chart | None:
    """Token entropy histograms on log-spaced bins, one line per (key, counts per bin, count below the first
    edge); y = share of the tokens in each bin, both axes log. Points: the bins with tokens."""
    import matplotlib
    from matplotlib import colormaps

    hists = [(k, c, b) for k, c, b in hists if sum(c) + b]
    if not hists:
        return None
    centers = [math.sqrt(a * b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    cmap = colormaps["viridis"]
    points: dict[str, int] = {}
    with matplotlib.rc_context(_RC):
        fig = _figure((6.0, 2.9))
        ax = fig.subplots()
        for i, (key, counts, below) in enumerate(hists):
            total = sum(counts) + below
            xs = [x for x, n in zip(centers, counts, strict=True) if n]
            ys = [n / total for n in counts if n]
            color = cmap(i / max(1, len(hists) - 1))
            (line,) = ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.0, color=color, label=key)
            line.set_gid(f"{chart_id}--{key.replace(' ', '_')}")
            points[key.replace(" ", "_")] = len(xs)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("token entropy (nats), log-spaced bins")
        ax.set_ylabel("share of tokens")
        ax.grid(alpha=0.25)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0,
                  ncol=1 + len(hists) // 12)
        return Chart(chart_id, title, _svg(fig, chart_id), points, note)


def bar_chart(chart_id: str, title: str, categories: Sequence[str], groups: Sequence[tuple[str, Sequence[float]]],
              ylabel: str, colors: Sequence[str] = (), note: str = "") -> Chart | None:
    """Grouped bars: for each (key, one value per category) a bar per category, side by side."""
    import matplotlib

    if not categories or not groups:
        return None
    width = 0.8 / len(groups)
    points: dict[str, int] = {}
    with matplotlib.rc_context(_RC):
        fig = _figure((5.0, 2.6))
        ax = fig.subplots()
        for i, (key, values) in enumerate(groups):
            xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(categories))]
            bars = ax.bar(xs, values, width=width, label=key,
                          color=colors[i] if i < len(colors) else COLORS[i % len(COLORS)])
            for j, b in enumerate(bars):  # a patch's group: "<chart>--<key>--<j>"
                b.set_gid(f"{chart_id}--{key.replace(' ', '_')}--{j}")
            points[key.replace(" ", "_")] = len(values)
            for x, v in zip(xs, values, strict=True):
                ax.annotate(f"{v:.0%}", (x, v), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max(1.0, max(max(v) for _, v in groups) * 1.15))
        ax.legend(loc="best", frameon=False)
        return Chart(chart_id, title, _svg(fig, chart_id), points, note)
