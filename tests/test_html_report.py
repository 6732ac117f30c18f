"""The HTML page (`qcal report`, `qcal calibrate --html`) and the compact histograms it plots."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from html import escape
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from qcal.cli import main
from qcal.numerics.histogram import HistogramObserver, compact_histogram, percentile_range
from qcal.numerics.observers import PerTensor
from qcal.report import report_schema

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
SECTIONS = ("summary", "histograms", "sensitivity", "fallback", "tensors")

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (the extra qcal[report])",
)


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def entropy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of the digits CNN calibrated with a histogram method, sensitivity measured."""
    out = tmp_path_factory.mktemp("entropy")
    report = out / "q.json"
    result = run("calibrate", DIGITS, "-o", out / "q.onnx", "--report", report, "-q",
                 "--method", "entropy", "--sensitivity")
    assert result.exit_code == 0, result.output
    return report


# ------------------------------------------------------------------ the compact histogram


def test_compact_histogram_counts_match_numpy_within_a_bin() -> None:
    rng = np.random.default_rng(3)
    data = np.concatenate([rng.standard_normal(50_000), 4 + rng.standard_normal(20_000)])
    data = data.astype(np.float32)
    observer = HistogramObserver(PerTensor())
    for chunk in np.array_split(data, 7):
        observer.update(chunk)
    compact = compact_histogram(observer.state(), symmetric=True)
    assert compact is not None
    assert compact.low == float(data.min()) and compact.high == float(data.max())
    assert compact.counts.size == 128
    expected, _ = np.histogram(data.astype(np.float64), bins=128, range=(compact.low, compact.high))
    # Every value is known to within 1/256 of itself: a count moves at most to a neighbour bin.
    assert abs(int(compact.counts.sum()) - data.size) <= 128
    assert np.abs(np.cumsum(compact.counts) - np.cumsum(expected)).max() < 0.01 * data.size
    for p in (99.9, 99.99, 99.999):
        low, high = compact.candidates[f"percentile {p:g}"]
        # within the bin of the order statistic of rank ceil(p n), 1/256 of it relatively
        threshold = np.percentile(np.abs(data.astype(np.float64)), p, method="inverted_cdf")
        assert high == pytest.approx(min(threshold, data.max()), rel=2 ** -7)
        assert low == pytest.approx(max(-threshold, data.min()), rel=2 ** -7)
    assert compact.candidates["minmax"] == (compact.low, compact.high)
    for symmetric in (True, False):  # exactly what --method percentile chooses
        both = compact_histogram(observer.state(), symmetric=symmetric)
        assert both is not None
        for p in (99.9, 99.99, 99.999):
            stats = percentile_range(observer.state(), p, symmetric=symmetric).stats
            assert both.candidates[f"percentile {p:g}"] == (float(stats.min), float(stats.max))


def test_compact_histogram_of_a_constant_has_one_bin() -> None:
    observer = HistogramObserver(PerTensor())
    observer.update(np.full(10, 2.5, np.float32))
    compact = compact_histogram(observer.state(), symmetric=True)
    assert compact is not None and compact.counts.tolist() == [10]


def test_report_keeps_histograms_of_histogram_methods_only(entropy_run: Path, tmp_path: Path) -> None:
    report = json.loads(entropy_run.read_text())
    jsonschema.validate(report, report_schema())
    activations = [t for t in report["tensors"] if t["role"] == "activation"]
    kept = [t for t in activations if "histogram" in t]
    assert kept and all(len(t["histogram"]["counts"]) <= 128 for t in kept)
    for tensor in kept:  # the stored counts cover every observed value (up to rounding)
        assert tensor["histogram"]["low"] == tensor["statistics"]["min"][0]
        assert tensor["histogram"]["high"] == tensor["statistics"]["max"][0]
        values = tensor["range"]["histogram"]["values"][0]
        assert abs(sum(tensor["histogram"]["counts"]) - values) <= 128
    assert all("histogram" not in t for t in report["tensors"] if t["role"] != "activation")
    minmax = tmp_path / "m.json"
    assert run("calibrate", DIGITS, "-o", tmp_path / "m.onnx", "--report", minmax, "-q",
               "--method", "minmax", "--no-fallback").exit_code == 0
    assert all("histogram" not in t for t in json.loads(minmax.read_text())["tensors"])


# ------------------------------------------------------------------ the page


@needs_matplotlib
def test_report_command_writes_every_section_self_contained(entropy_run: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    result = run("report", entropy_run, "-o", page)
    assert result.exit_code == 0, result.output
    text = page.read_text(encoding="utf-8")
    for section in SECTIONS:
        assert f'<section id="{section}">' in text
    report = json.loads(entropy_run.read_text())
    with_histogram = [t["name"] for t in report["tensors"] if "histogram" in t]
    plotted = re.findall(r'<div class="plot" data-tensor="([^"]+)">', text)
    assert sorted(plotted) == sorted(with_histogram)
    # worst first: the sensitivity measurement's order
    ranked = [r["tensor"] for r in report["sensitivity"]["tensors"] if r["tensor"] in plotted]
    assert ranked and plotted[: len(ranked)] == ranked
    assert text.count("<tr data-name=") == len(report["tensors"])
    # nothing is fetched: no external script, style, font or image
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", text)
    assert "@import" not in text and "url(http" not in text
    assert not re.search(r"\b(src|href)=\"(https?:)?//", text)
    # SVG ids are unique across the page
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids))


def _render_in_new_process(report: Path, page: Path) -> bytes:
    code = "from qcal.cli import main; main()"
    subprocess.run([sys.executable, "-c", code, "report", str(report), "-o", str(page)],
                   check=True, capture_output=True)
    return page.read_bytes()


@needs_matplotlib
def test_page_is_byte_identical_across_processes(entropy_run: Path, tmp_path: Path) -> None:
    first = _render_in_new_process(entropy_run, tmp_path / "a.html")
    second = _render_in_new_process(entropy_run, tmp_path / "b.html")
    assert first == second
    assert b"<dc:date>" not in first and b"Matplotlib v" not in first


def _without_timings(page: bytes) -> bytes:
    return re.sub(rb'<div id="timings">.*?</div>', b"", page, flags=re.DOTALL)


@needs_matplotlib
def test_calibrate_html_is_identical_for_identical_runs_but_the_timings(tmp_path: Path) -> None:
    pages = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        result = run("calibrate", DIGITS, "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json",
                     "--html", folder / "q.html", "--method", "percentile", "--force", "-q")
        assert result.exit_code == 0, result.output
        pages.append((folder / "q.html").read_bytes())
    assert b'id="timings"' in pages[0]
    assert _without_timings(pages[0]) == _without_timings(pages[1])


@needs_matplotlib
def test_histogram_plots_are_capped(entropy_run: Path, tmp_path: Path) -> None:
    from qcal.html_report import MAX_HISTOGRAM_PLOTS, render_html

    report = json.loads(entropy_run.read_text())
    source = next(t for t in report["tensors"] if "histogram" in t)
    extra = []
    for i in range(MAX_HISTOGRAM_PLOTS + 5):
        copied = copy.deepcopy(source)
        copied["name"] = f"copy_{i:03d}"
        extra.append(copied)
    report["tensors"] += extra
    report["sensitivity"] = None
    text = render_html(report).decode()
    total = sum("histogram" in t for t in report["tensors"])
    assert text.count('<div class="plot" data-tensor=') == MAX_HISTOGRAM_PLOTS
    assert f"Showing {MAX_HISTOGRAM_PLOTS} of {total} tensors" in text
    assert "Not measured" in text  # the sensitivity section says why it is empty


def test_estimated_sqnr_of_a_uniform_tensor() -> None:
    from qcal.html_report._tensors import estimated_sqnr_db

    # 128 equal bins over [0, 1), grid [0, 1] in steps of 1/255: signal E[x^2] = 1/3 (bin
    # centres: sum((i + 0.5)^2) / 128^3), noise step^2 / 12.
    histogram = {"low": 0.0, "high": 1.0, "counts": [10] * 128, "candidates": {}}
    step = 1 / 255
    centres = (np.arange(128) + 0.5) / 128
    expected = 10 * np.log10(np.mean(centres**2) / (step**2 / 12))
    assert estimated_sqnr_db(histogram, (0.0, 1.0), step) == pytest.approx(expected)
    # a grid that clips the top half adds the distance to its end
    clipped = np.minimum(centres, 0.5)
    noise = np.mean(np.where(centres <= 0.5, step**2 / 12, 0.0) + (centres - clipped) ** 2)
    assert estimated_sqnr_db(histogram, (0.0, 0.5), step) == pytest.approx(
        10 * np.log10(np.mean(centres**2) / noise))


# ------------------------------------------------------------------ errors


def _without_matplotlib(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from qcal.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, check=False)


def test_without_the_extra_both_commands_say_how_to_install_it(entropy_run: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    done = _without_matplotlib("report", entropy_run, "-o", page, cwd=tmp_path)
    assert done.returncode == 3
    assert "pip install 'qcal[report]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not page.exists()
    done = _without_matplotlib("calibrate", DIGITS, "--html", page, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "pip install 'qcal[report]'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing calibrated, nothing written


@needs_matplotlib
def test_a_file_that_is_not_a_report_is_bad_data(tmp_path: Path, entropy_run: Path) -> None:
    cases = {
        "missing.json": None,
        "text.json": "not json",
        "list.json": "[1, 2]",
        "old.json": json.dumps({"schema_version": 0}),
        "partial.json": json.dumps({"schema_version": 1}),
    }
    broken = json.loads(entropy_run.read_text())
    del broken["tensors"][0]["onnx"]
    cases["broken.json"] = json.dumps(broken)
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        result = CliRunner().invoke(main, ["report", str(tmp_path / name), "-o",
                                           str(tmp_path / "out.html")])
        assert result.exit_code == 5, (name, result.output)
        assert name in result.output
        assert not (tmp_path / "out.html").exists()


@needs_matplotlib
def test_html_of_a_run_is_the_page_of_its_report(tmp_path: Path) -> None:
    """--html and `qcal report` on the JSON written by the same run give the same bytes."""
    result = run("calibrate", DIGITS, "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json",
                 "--html", tmp_path / "run.html", "--method", "mse", "-q")
    assert result.exit_code == 0, result.output
    assert run("report", tmp_path / "q.json", "-o", tmp_path / "again.html").exit_code == 0
    assert (tmp_path / "run.html").read_bytes() == (tmp_path / "again.html").read_bytes()


@needs_matplotlib
def test_odd_tensor_names_are_shown_as_written(entropy_run: Path) -> None:
    from qcal.html_report import render_html

    report = json.loads(entropy_run.read_text())
    odd = 'odd $x_1^2$ <b>&"name"'
    first = report["sensitivity"]["tensors"][0]["tensor"]
    for entry in report["tensors"]:
        if entry["name"] == first:
            entry["name"] = odd
    report["sensitivity"]["tensors"][0]["tensor"] = odd
    text = render_html(report).decode()
    assert "odd $x_1^2$ &lt;b&gt;&amp;&quot;name&quot;" in text  # in the page's own markup
    assert "<b>&" not in text
    # and in the plots, as text (not typeset as TeX)
    sensitivity = text.split('<section id="sensitivity">')[1].split("</section>")[0]
    assert "odd $x_1^2$ &lt;b&gt;&amp;" in sensitivity


@needs_matplotlib
def test_a_report_with_nothing_measured_still_has_every_section(entropy_run: Path) -> None:
    from qcal.html_report import render_html

    report = json.loads(entropy_run.read_text())
    report.update(evaluation=None, sensitivity=None, fallback=None, output_model=None, gates=[],
                  warnings=[], tensors=[], timings_seconds={})
    text = render_html(report).decode()
    for section in SECTIONS:
        assert f'<section id="{section}">' in text
    assert "quality: not measured" in text and "latency not measured" in text
    assert "No histogram is stored" in text and '<span id="tensor-shown">0</span> of 0' in text


@needs_matplotlib
def test_gates_are_worded_as_the_terminal_words_them(entropy_run: Path) -> None:
    """A yes/no gate reads as a verdict, not "(1 yes, 0 no) 0 (threshold 1)"; a measured one
    gives its value and limit as the terminal's gate line does."""
    from qcal.accuracy.gates import GateResult
    from qcal.html_report import render_html

    report = json.loads(entropy_run.read_text())
    floor = GateResult("accuracy-floor", "accuracy floor above the coverage floor (see README; "
                       "62.50 % of the decisions agree) (1 yes, 0 no)", 1.0, 0.0, False)
    slower = GateResult("not-slower", "quantized/float latency on this machine, slower at 1 "
                        "thread (x)", 1.0, 1.2345, False)
    report["gates"] = [floor.to_json(), slower.to_json()]
    text = render_html(report).decode()
    for gate in (floor, slower):
        assert escape(gate.describe()) in text
    assert "(1 yes, 0 no)" not in text and "threshold 1)" not in text


@needs_matplotlib
def test_the_table_says_how_weight_codes_were_rounded(entropy_run: Path) -> None:
    from qcal.html_report import render_html

    report = json.loads(entropy_run.read_text())
    weight = next(t for t in report["tensors"] if t["role"] == "weight")
    weight["rounding"] = {"method": "gptq", "output_error_nearest": 0.002, "output_error": 0.0005}
    text = render_html(report).decode()
    row = re.search(rf'<tr data-name="{re.escape(weight["name"].lower())}".*?</tr>', text)
    assert row is not None
    assert "minmax, gptq (output error 0.0005 vs 0.002 nearest)" in row.group(0)
