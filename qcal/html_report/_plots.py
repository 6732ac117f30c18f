"""The page's plots: matplotlib figures written as inline SVG, byte-identical from run to run.

No pyplot (no global figure state, no GUI backend): each plot is a `Figure` drawn by the SVG
backend under fixed settings. The SVG's ids are derived from a fixed salt instead of random
ones, text stays text (no embedded glyphs, no fonts fetched), and the date and creator metadata
are left out. Each figure's ids are prefixed with its own number, so many plots share one page.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

__all__ = ["fallback_svg", "histogram_svg", "sensitivity_svg"]

_SETTINGS = {
    "svg.hashsalt": "qcal",
    "svg.fonttype": "none",
    "svg.image_inline": True,
    "font.size": 8.0,
    "font.family": "sans-serif",
    "axes.titlesize": 8.0,
    "axes.labelsize": 8.0,
    "legend.fontsize": 7.0,
    "path.simplify": True,
    "text.parse_math": False,  # a tensor name with $ signs is a name, not TeX
}
_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
_CHOSEN, _GRID, _DATA = "#c0392b", "#27ae60", "#34495e"
_CANDIDATE_STYLES = ((0, (4, 2)), (0, (1, 1.5)), (0, (6, 1, 1, 1)))


def _style() -> Any:
    """The fixed settings, for one figure's drawing and saving."""
    import matplotlib

    # cast: matplotlib types rc_context's keys as literals, ours are a plain mapping
    return cast(Any, matplotlib).rc_context(_SETTINGS)


def _svg(figure: Any, number: int, *, tight: bool = True) -> str:
    """`figure` as an <svg> element for inline use, its ids prefixed with `f<number>-`.

    `tight` fits the figure to what it draws, at the cost of drawing it twice: the histograms,
    drawn by the dozen, are laid out by hand instead."""
    buffer = io.StringIO()
    with _style():
        figure.savefig(buffer, format="svg", metadata=_METADATA,
                       **({"bbox_inches": "tight", "pad_inches": 0.04} if tight else {}))
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)
    # comments repeat each text (a name holding "-->" would end one early)
    text = re.sub(r"\s*<!--.*?-->", "", text, flags=re.DOTALL)
    prefix = f"f{number}-"
    text = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", text)
    text = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', text)
    return text.strip()


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    with _style():
        return Figure(figsize=(width, height), dpi=72)


def histogram_svg(
    number: int, name: str, histogram: Mapping[str, Any], chosen: tuple[float, float],
    grid: tuple[float, float] | None,
) -> str:
    """The tensor's values (log counts) with the chosen range, the quantization grid's range
    and the candidates' ranges marked."""
    import numpy as np
    from matplotlib.ticker import NullLocator

    counts = np.asarray(histogram["counts"], dtype=np.float64)
    low, high = float(histogram["low"]), float(histogram["high"])
    if high <= low:
        high = low + max(abs(low), 1.0) * 1e-3
    edges = np.linspace(low, high, counts.size + 1)
    with _style():
        figure = _figure(7.2, 1.8)
        axes = figure.add_axes((0.075, 0.16, 0.68, 0.70))
        axes.set_yscale("log")
        axes.yaxis.set_minor_locator(NullLocator())
        axes.stairs(np.maximum(counts, 0.5), edges, baseline=0.5, fill=True, color=_DATA,
                    alpha=0.55, linewidth=0)
        axes.set_ylim(bottom=0.5, top=max(float(counts.max()), 1.0) * 2.0)
        if grid is not None:
            axes.axvspan(grid[0], grid[1], color=_GRID, alpha=0.10, linewidth=0,
                         label="quantization grid")
        for value in chosen:
            axes.axvline(value, color=_CHOSEN, linewidth=1.3)
        axes.plot([], [], color=_CHOSEN, linewidth=1.3, label="chosen range")
        candidates = [(k, v) for k, v in histogram["candidates"].items() if k != "minmax"]
        for (label, (lo, hi)), style in zip(candidates, _CANDIDATE_STYLES):
            for value in (lo, hi):
                if value != 0.0 or low < 0.0:
                    axes.axvline(value, color="#7f8c8d", linewidth=0.8, linestyle=style)
            axes.plot([], [], color="#7f8c8d", linewidth=0.8, linestyle=style, label=label)
        span = high - low
        axes.set_xlim(min(low, *chosen) - 0.02 * span, max(high, *chosen) + 0.02 * span)
        axes.set_ylabel("count")
        axes.set_title(name, loc="left")
        axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.02), frameon=False)
        axes.grid(axis="y", alpha=0.25, linewidth=0.5)
    return _svg(figure, number, tight=False)


def sensitivity_svg(number: int, rows: Sequence[tuple[str, float]], label: str) -> str:
    """Horizontal bars, the first row on top."""
    with _style():
        figure = _figure(6.4, 0.6 + 0.17 * len(rows))
        axes = figure.add_subplot()
        names = [name if len(name) <= 48 else "…" + name[-47:] for name, _ in rows]
        positions = list(range(len(rows)))[::-1]
        axes.barh(positions, [value for _, value in rows], color=_CHOSEN, alpha=0.75, height=0.7)
        axes.set_yticks(positions, names)
        axes.set_xlabel(label)
        axes.grid(axis="x", alpha=0.25, linewidth=0.5)
        axes.margins(y=0.01)
    return _svg(figure, number)


def fallback_svg(
    number: int, points: Sequence[tuple[float, float, bool]], chosen: int | None, label: str,
    target: float | None,
) -> str:
    """Quality against the quantized share of compute, one point per model the fallback
    checked (filled where the target held), the chosen one circled."""
    ordered = sorted(range(len(points)), key=lambda i: points[i][0])
    with _style():
        figure = _figure(5.6, 2.4)
        axes = figure.add_subplot()
        axes.plot([points[i][0] for i in ordered], [points[i][1] for i in ordered],
                  color=_DATA, linewidth=1.0)
        for met in (True, False):
            group = [p for p in points if p[2] is met]
            if not group:
                continue
            axes.scatter([p[0] for p in group], [p[1] for p in group],
                         s=18, color=_GRID if met else _CHOSEN, zorder=3,
                         label="target met" if met else "target not met")
        if chosen is not None:
            axes.scatter([points[chosen][0]], [points[chosen][1]], s=120, facecolors="none",
                         edgecolors="black", linewidths=1.2, zorder=4, label="chosen")
        if target is not None:
            axes.axhline(target, color="#7f8c8d", linewidth=0.8, linestyle=(0, (4, 2)),
                         label="target")
        axes.set_xlabel("compute quantized (% of Conv/MatMul/Gemm MACs)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.25, linewidth=0.5)
        axes.legend(loc="best", frameon=False)
    return _svg(figure, number)
