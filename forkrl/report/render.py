"""Jinja2 for the report pages: the environment (templates are package data in forkrl/report/templates/, every
value HTML-escaped unless a template marks it safe: a model's output can never inject markup), the filters the
templates use, and the colours (token classes, the entropy scale).

    html = render("run.html.j2", context)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["CLASS_COLORS", "EntropyScale", "class_color", "entropy_scale", "render", "shown_token"]

# one colour per answer-token class (forkrl/data/problem.py TOKEN_CLASSES); tokens of a dataset have no class
CLASS_COLORS = {"choice": "#d62728", "computed": "#1f77b4", "copied": "#9467bd", "separator": "#8c8c8c",
                "eos": "#2ca02c", "other": "#bcbd22"}
ENTROPY_CMAP = "YlOrRd"  # light (near 0 nats) to dark red (high): the forks stand out


def class_color(cls: str | None) -> str:
    return CLASS_COLORS.get(cls or "", "#555555")


@dataclass(frozen=True)
class EntropyScale:
    """Token entropy -> background colour, on a square-root scale from 0 to `vmax` (most tokens sit near 0 nats:
    a linear scale would leave them all white); values above vmax get the top colour."""

    vmax: float

    def frac(self, h: float) -> float:
        return min(1.0, math.sqrt(max(h, 0.0) / self.vmax))

    def colors(self, h: float) -> tuple[str, str]:
        """(background, text colour) for entropy h."""
        r, g, b, _ = _cmap()(self.frac(h))
        light = 0.299 * r + 0.587 * g + 0.114 * b > 0.55
        return _hex(r, g, b), "#111111" if light else "#ffffff"

    @property
    def gradient(self) -> str:
        """A CSS linear-gradient of the scale (the legend)."""
        stops = [f"{_hex(*_cmap()(i / 10)[:3])} {i * 10}%" for i in range(11)]
        return f"linear-gradient(to right, {', '.join(stops)})"

    @property
    def ticks(self) -> list[tuple[float, str]]:
        """(position in %, label) of a few entropies along the legend."""
        vals = [0.0, self.vmax / 100, self.vmax / 10, self.vmax / 2, self.vmax]
        return [(100 * self.frac(v), f"{v:.2g}") for v in vals]


def entropy_scale(values: Sequence[float]) -> EntropyScale:
    """The scale of a page: up to the 99th percentile of its tokens' entropies (at least 0.1 nats)."""
    vals = sorted(v for v in values if math.isfinite(v))
    top = vals[min(len(vals) - 1, int(0.99 * len(vals)))] if vals else 0.0
    return EntropyScale(max(0.1, top))


@cache
def _cmap() -> Any:
    from matplotlib import colormaps

    return colormaps[ENTROPY_CMAP]


def _hex(r: float, g: float, b: float) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(round(255 * x) for x in (r, g, b)))


def shown_token(text: str) -> str:
    """A token's text made visible on its own: leading/trailing spaces as ␣, newlines as ↵, empty as ∅."""
    if not text:
        return "∅"
    core = text.strip(" ")
    lead, trail = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    if not core:
        return "␣" * len(text)
    return ("␣" * lead + core + "␣" * trail).replace("\n", "↵").replace("\t", "⇥")


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, fmt)


@cache
def _env() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("forkrl.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(pct=_pct, num=_num, tokshow=shown_token, class_color=class_color)
    env.globals["class_colors"] = CLASS_COLORS
    return env


def render(template: str, context: dict[str, Any]) -> str:
    """The page `template` (a file in forkrl/report/templates/) filled with `context`. Chart SVGs in the context
    are marked safe by the templates (`|safe`): matplotlib writes them, escaping every text it draws."""
    return _env().get_template(template).render(**context)
