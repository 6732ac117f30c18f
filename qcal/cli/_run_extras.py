"""What `qcal calibrate` writes besides the model and the report: the HTML page.

Each extra is checked before the run starts (its dependency installed, its path writable), so a
missing extra or a bad path costs nothing, and written after the run from the report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qcal.graph.files.atomic import check_output_path, write_atomic
from qcal.numerics.errors import ConfigError

# calibrate's options that are not part of CalibrationConfig (nor of the config file).
EXTRA_OPTIONS = ("html",)


@dataclass(frozen=True)
class RunExtras:
    html: Path | None = None

    @classmethod
    def take(cls, params: dict[str, Any]) -> RunExtras:
        """Remove the extras' options from `params` (the rest build the config)."""
        return cls(**{name: params.pop(name) for name in EXTRA_OPTIONS})

    def check(self, *, inputs: Iterable[Path], outputs: Iterable[Path], force: bool) -> None:
        """Before any work: the extras can be made and written where asked."""
        if self.html is None:
            return
        from qcal.html_report import require_plotting

        require_plotting("--html")
        check_output_path(self.html, inputs=list(inputs), force=force, what="--html")
        for path in outputs:
            if path.resolve() == self.html.resolve():
                raise ConfigError(f"--html: {self.html} is also the path of another output")

    def write(self, report: Mapping[str, Any]) -> list[Path]:
        """Write the extras; returns the paths written."""
        if self.html is None:
            return []
        from qcal.html_report import render_html

        write_atomic(self.html, render_html(report))
        return [self.html]
