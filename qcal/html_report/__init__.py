"""The report as a page a person reads: one self-contained HTML file with the run's summary, the
histograms of its worst tensors, sensitivity bars, the fallback's curve and a tensor table.

The plots need matplotlib, the optional extra `qcal[report]`; `require_plotting` says how to
install it, before any work starts. The page is a pure function of the JSON report: the same
report gives the same bytes (the SVG ids come from a fixed salt, no date is written).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qcal.html_report._page import MAX_HISTOGRAM_PLOTS, MAX_SENSITIVITY_BARS, page
from qcal.numerics.errors import ConfigError

__all__ = ["INSTALL_HINT", "MAX_HISTOGRAM_PLOTS", "MAX_SENSITIVITY_BARS", "render_html",
           "require_plotting"]

INSTALL_HINT = "pip install 'qcal[report]'"


def require_plotting(what: str = "the HTML report") -> None:
    """Raise ConfigError saying how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs matplotlib: {INSTALL_HINT}") from None


def render_html(report: Mapping[str, Any]) -> bytes:
    """The page for `report` (a qcal JSON report, as `qcal.report.build_report` makes it)."""
    require_plotting()
    return page(report).encode("utf-8")
