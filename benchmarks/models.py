"""Benchmark models and their data: the sample models and the three PP-OCR models of rapidocr.

Every data set is written under ``benchmarks/.cache/data/<model>/`` (never committed):

- samples of one fixed shape are stacked into one ``<split>-<N>.npz`` (key = model input name,
  axis 0 = sample), the layout ``qcal calibrate --data`` reads as ``x[i:i+1]`` per sample;
- samples of different shapes (PP-OCR detection and recognition) are a folder ``<split>-<N>/`` of
  ``NNNNN.npz`` files, one sample each, hard-linked from a pool folder ``<split>/`` so that the
  32-, 64-, 128- and 256-sample sets share their files.

Sample ``i`` of a split depends only on ``(model, split, i)`` (a seeded generator per sample), so
the 32-sample set is the first 32 samples of the 256-sample set, and the ``calib`` and ``eval``
splits never share a sample.

PP-OCR inputs are rendered text (PIL + DejaVu fonts), preprocessed as rapidocr_onnxruntime 1.4.4
does (``ch_ppocr_det/utils.py`` ``DetPreProcess``, ``ch_ppocr_rec/text_recognize.py`` and
``ch_ppocr_cls/text_cls.py`` ``resize_norm_img``), with a numpy port of OpenCV's bilinear resize
so that neither OpenCV nor rapidocr's own module has to be imported.

Command line: ``python benchmarks/models.py --samples 32 --models ppocr_rec`` writes the data sets
and prints where they are; ``--show`` saves a few rendered images as PNG for a look.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
DATA_DIR = CACHE_DIR / "data"
RESULTS_DIR = BENCH_DIR / "results"
SAMPLE_MODELS_DIR = REPO_DIR / "sample_models"

RAPIDOCR_VERSION = "1.4.4"
# Bump when rendering or preprocessing changes: cached data of another version is rebuilt.
GENERATOR_VERSION = 1
SEED = 20240611
SPLITS = {"calib": 0, "eval": 1}

ALL_MODELS = ("digits_cnn", "transformer_block", "ppocr_det", "ppocr_rec", "ppocr_cls")
PPOCR_FILES = {
    "ppocr_det": "ch_PP-OCRv4_det_infer.onnx",
    "ppocr_rec": "ch_PP-OCRv4_rec_infer.onnx",
    "ppocr_cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
}

# rapidocr_onnxruntime 1.4.4 config.yaml values used by the preprocessing below.
DET_LIMIT_SIDE_LEN = 736  # Det.limit_side_len, with Det.limit_type "min"
DET_MEAN = (0.5, 0.5, 0.5)
DET_STD = (0.5, 0.5, 0.5)
REC_IMAGE_SHAPE = (3, 48, 320)  # Rec.rec_img_shape
CLS_IMAGE_SHAPE = (3, 48, 192)  # Cls.cls_image_shape
CLS_LABELS = ("0", "180")  # Cls.label_list

DEJAVU_DIRS = (
    Path("/usr/share/fonts/truetype/dejavu"),
    Path("/usr/share/fonts/dejavu"),
    Path("/usr/share/fonts/TTF"),
    Path("/usr/local/share/fonts"),
    Path("/Library/Fonts"),
)
# Faces used when present; DejaVuSans.ttf is required.
DEJAVU_FACES = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansCondensed.ttf",
    "DejaVuSans-Oblique.ttf",
)

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her are be this which or an had "
    "not but have were one all their there been has more when will would who so if out no about "
    "into than them can only other new some time could these two may then first any like now such "
    "over our even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used "
    "take three invoice total amount date order number customer account payment address street "
    "city phone email price quantity item description tax due balance receipt station report page "
    "chapter section table figure model data sample value result training quantized float onnx "
    "London Paris Berlin Tokyo Monday Friday January March October Street Road Avenue Hotel Bank"
)
WORDS = tuple(_WORD_TEXT.split())


class BenchmarkSetupError(RuntimeError):
    """Something the benchmark needs (a package, a font, a model file) is missing."""


# ----------------------------------------------------------------------------- packages, fonts


def ensure_packages(*, install: bool = True) -> None:
    """Make sure pillow and rapidocr_onnxruntime 1.4.4 are importable; pip-install them if allowed.

    The wheel is installed without its dependencies (OpenCV, shapely, pyclipper): only its model
    files and its source, which documents the preprocessing, are used, never imported.
    """
    wanted = []
    if importlib.util.find_spec("PIL") is None:
        wanted.append(["pillow"])
    if _installed_version("rapidocr_onnxruntime") != RAPIDOCR_VERSION:
        wanted.append(["--no-deps", f"rapidocr_onnxruntime=={RAPIDOCR_VERSION}"])
    for args in wanted:
        cmd = [sys.executable, "-m", "pip", "install", *args]
        if not install:
            raise BenchmarkSetupError(
                f"missing {args[-1]}; install it with: {' '.join(cmd)} (or drop --no-install)"
            )
        print(f"[setup] installing into {sys.prefix}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def rapidocr_dir() -> Path:
    """The installed rapidocr_onnxruntime package folder (found without importing it)."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkSetupError(
            f"rapidocr_onnxruntime is not installed; run: {sys.executable} -m pip install "
            f"--no-deps rapidocr_onnxruntime=={RAPIDOCR_VERSION}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def ppocr_model_path(name: str) -> Path:
    path = rapidocr_dir() / "models" / PPOCR_FILES[name]
    if not path.is_file():
        raise BenchmarkSetupError(f"{path}: not found in the installed rapidocr_onnxruntime")
    return path


def find_fonts() -> list[Path]:
    """DejaVu font files: $QCAL_BENCH_FONT_DIR, the system folders, then matplotlib's copy."""
    dirs = []
    if os.environ.get("QCAL_BENCH_FONT_DIR"):
        dirs.append(Path(os.environ["QCAL_BENCH_FONT_DIR"]))
    dirs.extend(DEJAVU_DIRS)
    mpl = importlib.util.find_spec("matplotlib")
    if mpl is not None and mpl.submodule_search_locations:
        dirs.append(Path(next(iter(mpl.submodule_search_locations))) / "mpl-data" / "fonts" / "ttf")
    for folder in dirs:
        if (folder / "DejaVuSans.ttf").is_file():
            return [folder / face for face in DEJAVU_FACES if (folder / face).is_file()]
    raise BenchmarkSetupError(
        "no DejaVuSans.ttf found (looked in $QCAL_BENCH_FONT_DIR, "
        + ", ".join(str(d) for d in DEJAVU_DIRS)
        + ", matplotlib's mpl-data/fonts/ttf). Install one: `apt-get install -y fonts-dejavu-core` "
        "(Debian/Ubuntu, after apt-get update), `pip install matplotlib`, or point "
        "QCAL_BENCH_FONT_DIR at a folder holding DejaVuSans.ttf"
    )


# ----------------------------------------------------------------------------- OpenCV ports


def resize_linear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """``cv2.resize(img, (width, height))`` (INTER_LINEAR) for uint8 HxWxC images, in numpy.

    A port of OpenCV's fixed-point path: float32 source positions with half-pixel centres,
    11-bit weights rounded one by one, an exact horizontal pass, and the vectorised vertical pass
    ``((h0 >> 4) * b0 >> 16) + ((h1 >> 4) * b1 >> 16) + 2 >> 2``. Columns are clamped at the
    edges with their weight moved to the edge pixel; rows are not (both taps read the edge row
    with the unclamped weights), as OpenCV does. Bit-identical to opencv-python 5.0 (AVX2) on
    random images and sizes.
    """
    if img.dtype != np.uint8 or img.ndim != 3:
        raise ValueError(f"expected a uint8 HxWxC image, got {img.dtype} {img.shape}")
    src_h, src_w = img.shape[:2]
    if (src_h, src_w) == (height, width):
        return img.copy()
    y0, y1, b0, b1 = _linear_taps(src_h, height, clamp_weights=False)
    x0, x1, a0, a1 = _linear_taps(src_w, width, clamp_weights=True)
    pixels = img.astype(np.int64)
    horiz = pixels[:, x0] * a0[None, :, None] + pixels[:, x1] * a1[None, :, None]
    top = ((horiz[y0] >> 4) * b0[:, None, None]) >> 16
    bottom = ((horiz[y1] >> 4) * b1[:, None, None]) >> 16
    return np.clip((top + bottom + 2) >> 2, 0, 255).astype(np.uint8)


def _linear_taps(src: int, dst: int, *, clamp_weights: bool) -> tuple[np.ndarray, ...]:
    """Source indices and 11-bit weights of OpenCV's linear interpolation along one axis."""
    scale = 1.0 / (dst / src)
    pos = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    left = np.floor(pos).astype(np.int64)
    frac = (pos - left.astype(np.float32)).astype(np.float32)
    if clamp_weights:
        outside = (left < 0) | (left >= src - 1)
        frac[outside] = 0
        left = np.clip(left, 0, src - 1)
    w0 = np.rint((np.float32(1) - frac) * np.float32(2048)).astype(np.int64)
    w1 = np.rint(frac * np.float32(2048)).astype(np.int64)
    return np.clip(left, 0, src - 1), np.clip(left + 1, 0, src - 1), w0, w1


def det_preprocess(img_bgr: np.ndarray) -> np.ndarray:
    """rapidocr 1.4.4 TextDetector: limit_type "min", limit_side_len 736, /255, mean/std, NCHW.

    The short side is scaled up to 736 when smaller, both sides are rounded to multiples of 32,
    then ``(x * (1/255) - mean) / std`` (float64, as rapidocr's float64 mean/std arrays make it)
    and cast to float32 with a batch axis.
    """
    h, w = img_bgr.shape[:2]
    ratio = 1.0
    if min(h, w) < DET_LIMIT_SIDE_LEN:
        ratio = DET_LIMIT_SIDE_LEN / h if h < w else DET_LIMIT_SIDE_LEN / w
    resize_h = round(int(h * ratio) / 32) * 32
    resize_w = round(int(w * ratio) / 32) * 32
    resized = resize_linear(img_bgr, resize_w, resize_h)
    norm = (resized.astype("float32") * (1 / 255.0) - np.array(DET_MEAN)) / np.array(DET_STD)
    return np.expand_dims(norm.transpose((2, 0, 1)), axis=0).astype(np.float32)


def rec_preprocess(img_bgr: np.ndarray) -> np.ndarray:
    """rapidocr 1.4.4 TextRecognizer for one image (a batch of one): height 48, width by ratio.

    ``max_wh_ratio = max(320/48, w/h)``, padded width ``int(48 * max_wh_ratio)``, resized width
    ``ceil(48 * w/h)`` capped at it; ``(x/255 - 0.5) / 0.5``; zero padding on the right.
    """
    channels, img_h, img_w = REC_IMAGE_SHAPE
    h, w = img_bgr.shape[:2]
    max_wh_ratio = max(img_w / img_h, w * 1.0 / h)
    return _resize_norm_pad(img_bgr, channels, img_h, int(img_h * max_wh_ratio))[np.newaxis]


def cls_preprocess(img_bgr: np.ndarray) -> np.ndarray:
    """rapidocr 1.4.4 TextClassifier.resize_norm_img: 3x48x192, width by ratio capped at 192."""
    channels, img_h, img_w = CLS_IMAGE_SHAPE
    return _resize_norm_pad(img_bgr, channels, img_h, img_w)[np.newaxis]


def _resize_norm_pad(img: np.ndarray, channels: int, img_h: int, img_w: int) -> np.ndarray:
    h, w = img.shape[:2]
    ratio = w / float(h)
    resized_w = min(math.ceil(img_h * ratio), img_w)
    resized = resize_linear(img, resized_w, img_h).astype("float32")
    resized = resized.transpose((2, 0, 1)) / 255
    resized -= 0.5
    resized /= 0.5
    padded = np.zeros((channels, img_h, img_w), dtype=np.float32)
    padded[:, :, 0:resized_w] = resized
    return padded


# ----------------------------------------------------------------------------- text rendering


@dataclass
class Renderer:
    """Seeded text rendering with the DejaVu faces found on this machine."""

    fonts: list[Path] = field(default_factory=find_fonts)
    _cache: dict[tuple[int, int], Any] = field(default_factory=dict)

    def font(self, index: int, size: int) -> Any:
        from PIL import ImageFont

        key = (index, size)
        if key not in self._cache:
            self._cache[key] = ImageFont.truetype(str(self.fonts[index]), size)
        return self._cache[key]

    def random_font(self, rng: np.random.Generator, low: int, high: int) -> tuple[Any, int]:
        size = int(rng.integers(low, high + 1))
        return self.font(int(rng.integers(len(self.fonts))), size), size

    def line(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """A text-line crop as rapidocr cuts it from a page: text plus a small margin, BGR."""
        font, size = self.random_font(rng, 18, 44)
        text = random_text(rng, max_words=5)
        left, top, right, bottom = font.getbbox(text)
        margin_x = round(size * rng.uniform(0.1, 0.5))
        margin_y = round(size * rng.uniform(0.1, 0.35))
        width, height = right - left + 2 * margin_x, bottom - top + 2 * margin_y
        image, draw, ink = _canvas(rng, width, height)
        draw.text((margin_x - left, margin_y - top), text, font=font, fill=ink)
        return _finish(rng, image), text

    def page(self, rng: np.random.Generator) -> tuple[np.ndarray, list[list[int]], list[str]]:
        """A page with 5-16 text lines at seeded positions; ink boxes [x0, y0, x1, y1] per line."""
        height, width = int(rng.integers(480, 800)), int(rng.integers(560, 1000))
        image, draw, ink = _canvas(rng, width, height)
        boxes: list[list[int]] = []
        texts: list[str] = []
        y = int(rng.integers(12, 60))
        max_lines = int(rng.integers(5, 17))
        while len(boxes) < max_lines:
            font, size = self.random_font(rng, 14, 40)
            x = int(rng.integers(12, max(13, width // 3)))
            placed = _fit_line(rng, font, x, y, width - 12)
            if placed is None or placed[0][3] > height - 12:
                break
            segments = [placed]
            # a second column on the same line now and then, well separated from the first
            gap_x = placed[0][2] + 3 * size
            if rng.random() < 0.3 and gap_x < width - 60:
                second = _fit_line(rng, font, gap_x, y, width - 12)
                if second is not None:
                    segments.append(second)
            for box, text in segments:
                left, top, _, _ = font.getbbox(text)
                draw.text((box[0] - left, box[1] - top), text, font=font, fill=ink)
                boxes.append(box)
                texts.append(text)
            y = max(b[3] for b, _ in segments) + int(
                rng.integers(int(0.4 * size), int(1.8 * size) + 1)
            )
        return _finish(rng, image), boxes, texts


def _fit_line(
    rng: np.random.Generator, font: Any, x: int, y: int, right_limit: int
) -> tuple[list[int], str] | None:
    """Ink box and text of a seeded line starting at (x, y) that ends before right_limit."""
    words = random_text(rng, max_words=8).split(" ")
    while words:
        text = " ".join(words)
        left, top, right, bottom = font.getbbox(text)
        if x + right - left <= right_limit:
            return [x, y, x + right - left, y + bottom - top], text
        words.pop()
    return None


def random_text(rng: np.random.Generator, max_words: int) -> str:
    """Seeded words, numbers, dates and prices; every character is in PP-OCRv4's dictionary."""
    parts = []
    for _ in range(int(rng.integers(1, max_words + 1))):
        kind = rng.random()
        if kind < 0.12:
            parts.append(str(int(rng.integers(0, 100000))))
        elif kind < 0.17:
            parts.append(
                f"{int(rng.integers(1990, 2031))}-{int(rng.integers(1, 13)):02d}-"
                f"{int(rng.integers(1, 29)):02d}"
            )
        elif kind < 0.21:
            parts.append(f"${int(rng.integers(1, 1000))}.{int(rng.integers(0, 100)):02d}")
        else:
            word = WORDS[int(rng.integers(len(WORDS)))]
            style = rng.random()
            parts.append(
                word.upper() if style < 0.06 else word.capitalize() if style < 0.3 else word
            )
    text = " ".join(parts)
    if rng.random() < 0.25:
        text += ".,:;!?"[int(rng.integers(6))]
    return text


def _canvas(rng: np.random.Generator, width: int, height: int) -> tuple[Any, Any, tuple[int, ...]]:
    from PIL import Image, ImageDraw

    base = int(rng.integers(200, 256))
    paper = tuple(int(np.clip(base + rng.integers(-12, 13), 0, 255)) for _ in range(3))
    dark = int(rng.integers(0, 90))
    ink = tuple(int(np.clip(dark + rng.integers(-20, 21), 0, 255)) for _ in range(3))
    image = Image.new("RGB", (width, height), paper)
    return image, ImageDraw.Draw(image), ink


def _finish(rng: np.random.Generator, image: Any) -> np.ndarray:
    """RGB PIL image -> BGR uint8 array (OpenCV order, as rapidocr's LoadImage returns), + noise."""
    rgb = np.asarray(image, dtype=np.float32)
    sigma = rng.uniform(0.0, 6.0)
    noisy = rgb + rng.standard_normal(rgb.shape, dtype=np.float32) * sigma
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)[:, :, ::-1].copy()


# ----------------------------------------------------------------------------- models and data


Sample = tuple[np.ndarray, dict[str, Any]]


@dataclass(frozen=True)
class BenchModel:
    """A model of the benchmark with a way to write its calibration and evaluation data."""

    name: str
    path: Path
    input_name: str
    task: str  # "classify" | "hidden" | "det" | "rec" | "cls"
    fixed_shape: bool  # True: samples stack into one .npz; False: a folder of .npz files
    make_sample: Callable[[str, int], Sample] = field(repr=False, compare=False)
    unique_samples: dict[str, int | None] = field(default_factory=dict, compare=False)

    def calib_data(self, n: int) -> Path:
        return self.data("calib", n)

    def eval_data(self, n: int) -> Path:
        return self.data("eval", n)

    def data(self, split: str, n: int) -> Path:
        """Path of the `split` data set with `n` samples, written on first use."""
        return _ensure_split(self, split, n)

    def truth(self, split: str, n: int) -> list[dict[str, Any]]:
        """Per-sample ground truth of a data set (rendered text, boxes, labels)."""
        self.data(split, n)
        return json.loads(_truth_path(self, split, n).read_text())


def get_models(names: Sequence[str] = ALL_MODELS, *, install: bool = True) -> list[BenchModel]:
    """The named benchmark models; PP-OCR ones install pillow/rapidocr first when allowed."""
    unknown = [n for n in names if n not in ALL_MODELS]
    if unknown:
        raise BenchmarkSetupError(
            f"unknown model(s) {unknown}; choose from {', '.join(ALL_MODELS)}"
        )
    if any(n.startswith("ppocr_") for n in names):
        ensure_packages(install=install)
    renderer = Renderer() if any(n.startswith("ppocr_") for n in names) else None
    return [_build_model(name, renderer) for name in names]


def _build_model(name: str, renderer: Renderer | None) -> BenchModel:
    if name in ("digits_cnn", "transformer_block"):
        path = SAMPLE_MODELS_DIR / f"{name}.onnx"
        key = "image" if name == "digits_cnn" else "tokens"
        pools = {split: SAMPLE_MODELS_DIR / f"{name}.{split}.npz" for split in SPLITS}
        sizes = {split: _npz_rows(p, key) for split, p in pools.items()}
        labels = SAMPLE_MODELS_DIR / f"{name}.eval.labels.npy"

        def sample(split: str, i: int) -> Sample:
            # The shipped sets are finite: larger requests cycle through them (see README).
            rows = _npz_cached(pools[split], key)
            truth: dict[str, Any] = {"source_index": i % len(rows)}
            if split == "eval" and labels.is_file():
                truth["label"] = int(np.load(labels)[i % len(rows)])
            return rows[i % len(rows)][np.newaxis], truth

        task = "classify" if name == "digits_cnn" else "hidden"
        return BenchModel(name, path, key, task, True, sample, dict(sizes))
    assert renderer is not None
    path = ppocr_model_path(name)
    stream = {"ppocr_det": 10, "ppocr_rec": 11, "ppocr_cls": 12}[name]

    def ppocr_sample(split: str, i: int) -> Sample:
        rng = np.random.default_rng([SEED, stream, SPLITS[split], i])
        if name == "ppocr_det":
            page, boxes, texts = renderer.page(rng)
            x = det_preprocess(page)
            return x, {"boxes": boxes, "texts": texts, "image_hw": list(page.shape[:2])}
        line, text = renderer.line(rng)
        if name == "ppocr_rec":
            return rec_preprocess(line), {"text": text}
        upside_down = bool(rng.random() < 0.5)
        if upside_down:
            line = np.ascontiguousarray(line[::-1, ::-1])  # = cv2.rotate(ROTATE_180)
        return cls_preprocess(line), {"text": text, "label": int(upside_down)}

    return BenchModel(
        name,
        path,
        "x",
        name.removeprefix("ppocr_"),
        name == "ppocr_cls",
        ppocr_sample,
        {s: None for s in SPLITS},
    )


_NPZ_CACHE: dict[tuple[Path, str], np.ndarray] = {}


def _npz_cached(path: Path, key: str) -> np.ndarray:
    if (path, key) not in _NPZ_CACHE:
        with np.load(path, allow_pickle=False) as data:
            _NPZ_CACHE[(path, key)] = data[key]
    return _NPZ_CACHE[(path, key)]


def _npz_rows(path: Path, key: str) -> int:
    return int(_npz_cached(path, key).shape[0])


def _model_dir(model: BenchModel) -> Path:
    return DATA_DIR / model.name


def _truth_path(model: BenchModel, split: str, n: int) -> Path:
    return _model_dir(model) / f"{split}-{n}.truth.json"


def _stamp() -> dict[str, Any]:
    return {"generator_version": GENERATOR_VERSION, "seed": SEED, "rapidocr": RAPIDOCR_VERSION}


def _check_stamp(model: BenchModel) -> None:
    """Wipe a model's cached data written by another generator version or with other fonts."""
    folder = _model_dir(model)
    stamp = dict(_stamp(), model_bytes=model.path.stat().st_size)
    if model.name.startswith("ppocr_"):
        stamp["fonts"] = [p.name for p in find_fonts()]
    stamp_file = folder / "STAMP.json"
    if folder.is_dir():
        if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
            return
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")


def _ensure_split(model: BenchModel, split: str, n: int) -> Path:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if n < 1:
        raise ValueError(f"sample count must be at least 1, got {n}")
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    # one writer at a time: benchmark runs started side by side share this cache
    with open(DATA_DIR / f".{model.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _check_stamp(model)
        return _write_split(model, split, n)


def _write_split(model: BenchModel, split: str, n: int) -> Path:
    folder = _model_dir(model)
    target = folder / (f"{split}-{n}.npz" if model.fixed_shape else f"{split}-{n}")
    truth_file = _truth_path(model, split, n)
    if target.exists() and truth_file.is_file():
        return target
    truths = []
    if model.fixed_shape:
        arrays = []
        for i in range(n):
            x, truth = model.make_sample(split, i)
            arrays.append(x)
            truths.append(truth)
        tmp = target.with_name(target.name + ".tmp.npz")
        np.savez(tmp, **{model.input_name: np.concatenate(arrays, axis=0)})
        os.replace(tmp, target)
        labels = [t["label"] for t in truths if "label" in t]
        if len(labels) == n:  # qcal finds <stem>.labels.npy beside an evaluation .npz
            np.save(target.with_name(f"{split}-{n}.labels.npy"), np.array(labels, dtype=np.int64))
    else:
        pool = folder / split
        pool.mkdir(exist_ok=True)
        tmp_dir = folder / f".{split}-{n}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir()
        for i in range(n):
            sample_file = pool / f"{i:05d}.npz"
            truth_file_i = pool / f"{i:05d}.json"
            if not (sample_file.is_file() and truth_file_i.is_file()):
                x, truth = model.make_sample(split, i)
                np.savez(pool / f"{i:05d}.tmp.npz", **{model.input_name: x})
                os.replace(pool / f"{i:05d}.tmp.npz", sample_file)
                truth_file_i.write_text(json.dumps(truth) + "\n")
            truths.append(json.loads(truth_file_i.read_text()))
            _link_or_copy(sample_file, tmp_dir / sample_file.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp_dir, target)
    truth_file.write_text(json.dumps(truths) + "\n")
    return target


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# ----------------------------------------------------------------------------- data reading


def iter_samples(path: Path, input_name: str) -> Any:
    """Yield one feed dict per sample from a stacked .npz or a folder of .npz files.

    `input_name` may list several inputs, comma-separated: each sample then feeds all of them
    (every input stacked on axis 0, as the generalisation models' data are)."""
    names = input_name.split(",")
    if path.is_dir():
        for file in sorted(path.glob("*.npz")):
            with np.load(file, allow_pickle=False) as data:
                yield {name: data[name] for name in names}
    else:
        with np.load(path, allow_pickle=False) as data:
            stacked = {name: data[name] for name in names}
        for i in range(stacked[names[0]].shape[0]):
            yield {name: array[i : i + 1] for name, array in stacked.items()}


def iter_batches(path: Path, input_name: str, batch_size: int) -> Any:
    """Feeds of `batch_size` samples stacked on axis 0 (the last may be smaller).

    Samples of different shapes cannot be stacked: a batch ends early at a shape change.
    """
    pending: list[dict[str, np.ndarray]] = []
    for feed in iter_samples(path, input_name):
        if pending and (len(pending) == batch_size or any(
                pending[0][k].shape[1:] != v.shape[1:] for k, v in feed.items())):
            yield {k: np.concatenate([p[k] for p in pending], axis=0) for k in feed}
            pending = []
        pending.append(feed)
    if pending:
        yield {k: np.concatenate([p[k] for p in pending], axis=0) for k in pending[0]}


def character_list(model_path: Path) -> list[str]:
    """rapidocr's CTC dictionary: "blank", the model's `character` metadata lines, then " "."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return ["blank", *meta["character"].splitlines(), " "]


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--samples", default="32", help="comma-separated sample counts")
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--no-install", action="store_true", help="never pip-install anything")
    parser.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="K",
        help="also save the first K rendered PP-OCR inputs as PNG",
    )
    args = parser.parse_args(argv)
    try:
        models = get_models(args.models.split(","), install=not args.no_install)
    except BenchmarkSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for model in models:
        for n in [int(s) for s in args.samples.split(",")]:
            print(f"{model.name}: calib {n} -> {model.calib_data(n)}")
        print(f"{model.name}: eval {args.eval_samples} -> {model.eval_data(args.eval_samples)}")
        if args.show and model.name.startswith("ppocr_"):
            _save_previews(model, args.show)
    return 0


def _save_previews(model: BenchModel, count: int) -> None:
    from PIL import Image

    out = CACHE_DIR / "preview"
    out.mkdir(parents=True, exist_ok=True)
    for i, feed in enumerate(iter_samples(model.calib_data(max(count, 1)), model.input_name)):
        if i >= count:
            break
        chw = feed[model.input_name][0]
        rgb = (
            np.clip((chw * 0.5 + 0.5) * 255, 0, 255).astype(np.uint8).transpose(1, 2, 0)[:, :, ::-1]
        )
        Image.fromarray(np.ascontiguousarray(rgb)).save(out / f"{model.name}-{i}.png")
    print(f"{model.name}: previews in {out}")


if __name__ == "__main__":
    sys.exit(main())
