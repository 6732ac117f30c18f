"""What `qcal calibrate` does besides writing the model and the report: the HTML page, the
comparison with a baseline report, the Markdown summary for CI and the one-line JSON summary.

Each extra is checked before the run starts (its dependency installed, its files readable and
writable), so a missing extra or a bad path costs nothing; each is made after the run from the
report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qcal.drift import Drift, compare_reports, drift_thresholds
from qcal.graph.files.atomic import check_output_path, write_atomic
from qcal.numerics.errors import ConfigError, OutputError

# calibrate's options that are not part of CalibrationConfig (nor of the config file).
EXTRA_OPTIONS = ("html", "baseline", "drift_threshold", "fail_on_drift", "summary_md", "as_json")
STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


@dataclass
class RunExtras:
    html: Path | None = None
    baseline: Path | None = None
    drift_threshold: tuple[str, ...] = ()
    fail_on_drift: bool = False
    summary_md: Path | None = None
    as_json: bool = False
    _baseline_report: dict[str, Any] | None = field(default=None, repr=False)
    _thresholds: dict[str, float] = field(default_factory=dict, repr=False)

    @classmethod
    def take(cls, params: dict[str, Any]) -> RunExtras:
        """Remove the extras' options from `params` (the rest build the config)."""
        return cls(**{name: params.pop(name) for name in EXTRA_OPTIONS})

    def check(self, *, inputs: Iterable[Path], outputs: Iterable[Path], force: bool) -> None:
        """Before any work: the extras can be made, read and written where asked."""
        from qcal.cli.diff import parse_thresholds

        read, taken = list(inputs), [p.resolve() for p in outputs]
        self._thresholds = drift_thresholds(parse_thresholds(self.drift_threshold))
        if self.baseline is not None:
            from qcal.report import load_report

            self._baseline_report = load_report(self.baseline, what="--baseline")
            read.append(self.baseline)
        elif self.fail_on_drift or self.drift_threshold:
            raise ConfigError("--fail-on-drift and --drift-threshold need --baseline OLD.json")
        if self.html is not None:
            from qcal.html_report import require_plotting

            require_plotting("--html")
        for path, option in ((self.html, "--html"), (self.summary_md, "--summary-md")):
            if path is None:
                continue
            check_output_path(path, inputs=read, force=force, what=option)
            if path.resolve() in taken:
                raise ConfigError(f"{option}: {path} is also the path of another output")
            taken.append(path.resolve())
        step_summary = os.environ.get(STEP_SUMMARY)
        if step_summary:  # appended to at the end: found unwritable now, not after the work
            try:
                with open(step_summary, "a", encoding="utf-8"):
                    pass
            except OSError as err:
                raise OutputError(f"${STEP_SUMMARY} {step_summary}: {err.strerror or err}") from None

    def drift(self, report: Mapping[str, Any]) -> Drift | None:
        if self._baseline_report is None or self.baseline is None:
            return None
        from qcal.report import reading_report

        with reading_report(self.baseline):
            return compare_reports(self._baseline_report, report, self._thresholds)

    def write(self, report: Mapping[str, Any], drift: Drift | None) -> list[Path]:
        """Write the page and the Markdown summary; returns the paths written."""
        written = []
        if self.html is not None:
            from qcal.html_report import render_html

            write_atomic(self.html, render_html(report))
            written.append(self.html)
        markdown = self.markdown(report, drift)
        if self.summary_md is not None:
            write_atomic(self.summary_md, markdown.encode("utf-8"))
            written.append(self.summary_md)
        step_summary = os.environ.get(STEP_SUMMARY)
        if step_summary:  # the CI job page: appended to, as each step of a job does
            try:
                with open(step_summary, "a", encoding="utf-8") as page:
                    page.write(markdown)
            except OSError as err:
                raise OutputError(f"${STEP_SUMMARY} {step_summary}: {err.strerror or err}") from None
        return written

    def markdown(self, report: Mapping[str, Any], drift: Drift | None) -> str:
        from qcal.ci_summary import markdown_summary

        return markdown_summary(report, drift=drift, fail_on_drift=self.fail_on_drift,
                                html=self.html)

    def json_line(self, report: Mapping[str, Any], drift: Drift | None,
                  report_path: Path | None) -> str:
        from qcal.ci_summary import machine_summary

        summary = machine_summary(report, drift=drift, fail_on_drift=self.fail_on_drift,
                                  report_path=report_path, html=self.html)
        return json.dumps(summary, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
