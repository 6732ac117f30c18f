"""The HTML page in a real browser: headless Chromium opens it, runs its script without a console
message, shows every section, and takes a screenshot.

Skipped when no Chromium is installed (`.ci/run` installs Debian's `chromium`) or without the
extra qcal[report]. QCAL_BROWSER names another Chromium-like browser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from qcal.cli import main

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
SECTIONS = ("summary", "histograms", "sensitivity", "fallback", "tensors")


def _browser() -> str | None:
    named = os.environ.get("QCAL_BROWSER")
    if named:
        return shutil.which(named)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


BROWSER = _browser()
pytestmark = [
    pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                       reason="matplotlib is not installed (the extra qcal[report])"),
]


def _headless(page: Path, profile: Path, *args: str,
              fragment: str = "") -> subprocess.CompletedProcess[str]:
    """Chromium on `page`, its console messages on stderr, every host name unresolvable (a page
    that fetched anything would log the failed load)."""
    assert BROWSER is not None
    command = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0",
        *args, page.as_uri() + fragment,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def _console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A page with every section filled: histograms (entropy), sensitivity, and a fallback that
    searched (a target the fully quantized model misses)."""
    out = tmp_path_factory.mktemp("browser")
    result = CliRunner().invoke(main, [
        "calibrate", str(DIGITS), "-o", str(out / "q.onnx"), "--report", str(out / "q.json"),
        "--html", str(out / "q.html"), "--method", "entropy", "--sensitivity",
        "--target-sqnr", "45", "-q",
    ], catch_exceptions=False)
    assert result.exit_code in (0, 7), result.output
    return out / "q.html"


def test_page_renders_every_section_without_console_messages(page: Path, tmp_path: Path) -> None:
    done = _headless(page, tmp_path / "profile", "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _console_messages(done.stderr) == []
    dom = done.stdout
    assert re.search(r'<body[^>]*data-ready="1"', dom), "the page's script did not run to its end"
    for section in SECTIONS:
        assert f'<section id="{section}">' in dom
    # the plots are there: histograms, the sensitivity bars and the fallback curve
    assert dom.count('<div class="plot"') >= 3
    assert dom.count("<svg") == dom.count('<div class="plot"')
    assert "Nothing was kept float by the fallback" not in dom and "Not measured" not in dom


def test_the_table_filter_runs_in_the_browser(page: Path, tmp_path: Path) -> None:
    done = _headless(page, tmp_path / "profile", "--dump-dom", fragment="#filter=conv2")
    assert _console_messages(done.stderr) == []
    rows = re.findall(r'<tr data-name="([^"]+)"[^>]*?( hidden="")?>', done.stdout)
    assert rows
    shown = [name for name, hidden in rows if not hidden]
    assert shown and shown == [name for name, _ in rows if "conv2" in name]
    count = re.search(r'<span id="tensor-shown">(\d+)</span>', done.stdout)
    assert count is not None and int(count.group(1)) == len(shown)


def test_page_screenshot(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    done = _headless(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,1600")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _console_messages(done.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 1600)
    # a blank page compresses to a few kB; text and plots do not
    assert len(data) > 50_000


def test_a_script_error_would_be_caught(tmp_path: Path) -> None:
    """The check itself: a page whose script fails shows up in the console messages."""
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><html><body><script>notDefined();</script></body></html>")
    done = _headless(broken, tmp_path / "profile", "--dump-dom")
    assert any("notDefined" in line for line in _console_messages(done.stderr))
