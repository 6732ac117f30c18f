"""Make docs/report.png, the README's picture of the HTML report.

Calibrates the bundled digits CNN (entropy ranges, sensitivity, and an SQNR target the fully
quantized model misses, so the fallback searches and every section of the page has something to
show), writes the page and takes a screenshot of its top with headless Chromium. Needs the extra
qcal[report] and a Chromium (`apt-get install chromium`):

    python docs/screenshot.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
WIDTH, HEIGHT, COLOURS = 1000, 1500, 64


def main() -> None:
    browser = next((b for b in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                           "google-chrome")) if b), None)
    if browser is None:
        sys.exit("no Chromium found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for name in ("digits_cnn.onnx", "digits_cnn.calib.npz", "digits_cnn.eval.npz",
                     "digits_cnn.eval.labels.npy"):
            shutil.copy(SAMPLES / name, work / name)
        subprocess.run([sys.executable, "-m", "qcal.cli", "calibrate", "digits_cnn.onnx",
                        "-o", "digits_cnn.qdq.onnx", "--report", "digits_cnn.qcal.json",
                        "--method", "entropy", "--sensitivity", "--target-sqnr", "41",
                        "--html", "digits_cnn.html", "-q"], cwd=work, check=False)
        shot = work / "report.png"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={work / 'profile'}", f"--window-size={WIDTH},{HEIGHT}",
                        f"--screenshot={shot}", (work / "digits_cnn.html").as_uri()],
                       check=True, capture_output=True)
        from PIL import Image  # comes with matplotlib

        with Image.open(shot) as image:  # a palette keeps the picture small
            image.convert("RGB").quantize(COLOURS).save(ROOT / "docs" / "report.png", optimize=True)
    print(f"wrote {ROOT / 'docs' / 'report.png'}")


if __name__ == "__main__":
    main()
