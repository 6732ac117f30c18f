"""Task accuracy of quantized PP-OCR models: float vs quantized, on rendered text.

For the detection, recognition and direction-classification models of rapidocr_onnxruntime
1.4.4, three quantized variants are made from the same calibration set and compared with the
float model on a disjoint evaluation set, with each task's own measure:

- det: text-box F1 between the float model's boxes and the quantized model's boxes, after a
  simplified DB postprocess (probability > 0.3, 2x2 dilation, connected components, mean-score
  filter >= 0.5, rectangle unclip by area * 1.6 / perimeter, IoU >= 0.5 one-to-one matching);
- rec: recognised-string agreement (CTC greedy decode with the model's own dictionary), plus the
  character error rate against the float strings;
- cls: agreement of the 0/180 degree decision.

Each also gets the float model's score against the rendered ground truth (a check that the inputs
and preprocessing are right) and the share of Conv/MatMul/Gemm multiply-accumulates left
quantized in the QDQ model ("coverage").

Variants: onnxruntime ``quantize_static`` with its defaults (every op type it knows; QDQ,
per-channel, QUInt8 activations, QInt8 weights, MinMax): "naive full quantization"; then the qcal
invocations listed in QCAL_VARIANTS below (edit the flags there).

    python benchmarks/eval_ppocr.py              # 64 calibration, 64 evaluation samples
    python benchmarks/eval_ppocr.py --quick      # 8 and 8
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    OutputAgreement,
    default_max_rss_mib,
    machine_info,
    ort_job,
    print_table,
    qcal_cli_cmd,
    run_child,
    run_worker,
    variant_sessions,
    work_dir,
    write_results,
)
from models import BenchmarkSetupError, BenchModel, character_list, get_models, iter_samples

# Extra `qcal calibrate` arguments per variant and task (det | rec | cls). The model, --data,
# -o, --report, --force and -q are added by the script. Flag names follow the fallback feature's
# design; change them here if the CLI settles on others.
QCAL_VARIANTS: dict[str, dict[str, list[str]]] = {
    "qcal default": {"det": [], "rec": [], "cls": []},
    # The MSE range method (instead of min-max) for every activation, nothing else changed.
    "qcal mse": {"det": ["--method", "mse"], "rec": ["--method", "mse"], "cls": ["--method", "mse"]},
    "qcal fallback": {
        "det": ["--target-sqnr", "20"],
        # rec's output is [N, steps, classes], per-step CTC probabilities. qcal's top-1 agreement
        # (so --max-agreement-drop) is defined for [N, classes] outputs, and per-step agreement
        # would be a poor target here: with 72 % of strings intact, 11 % of steps flip (the CTC
        # decoding absorbs most flips). So rec gets an SQNR target; qcal ranks its tensors by the
        # logits under the softmax.
        "rec": ["--target-sqnr", "12"],
        "cls": ["--max-agreement-drop", "1"],
    },
}
ORT_NAIVE = "ort naive"

DB_THRESH = 0.3  # rapidocr Det.thresh
DB_BOX_THRESH = 0.5  # rapidocr Det.box_thresh
DB_UNCLIP_RATIO = 1.6  # rapidocr Det.unclip_ratio
DB_MIN_SIZE = 3  # rapidocr DBPostProcess.min_size
IOU_MATCH = 0.5


# ----------------------------------------------------------------------------- det


def db_boxes(prob: np.ndarray) -> np.ndarray:
    """Axis-aligned text boxes [x0, y0, x1, y1] from a DB probability map (H, W)."""
    mask = prob > DB_THRESH
    # cv2.dilate with a 2x2 kernel (anchor at its centre): out[y, x] = max(in[y-1:y+1, x-1:x+1])
    dilated = mask.copy()
    dilated[1:, :] |= mask[:-1, :]
    dilated[:, 1:] |= mask[:, :-1]
    dilated[1:, 1:] |= mask[:-1, :-1]
    height, width = prob.shape
    boxes = []
    for ys, xs in _components(dilated):
        x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
        w, h = x1 - x0, y1 - y0
        if min(w, h) < DB_MIN_SIZE:
            continue
        if prob[y0:y1, x0:x1].mean() < DB_BOX_THRESH:
            continue
        grow = w * h * DB_UNCLIP_RATIO / (2 * (w + h))
        if min(w, h) + 2 * grow < DB_MIN_SIZE + 2:
            continue
        boxes.append(
            [
                max(0.0, x0 - grow),
                max(0.0, y0 - grow),
                min(float(width), x1 + grow),
                min(float(height), y1 + grow),
            ]
        )
    return np.array(boxes, dtype=np.float64).reshape(-1, 4)


def _components(mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """8-connected components as (row indices, column indices); scipy when installed."""
    try:
        from scipy import ndimage
    except ImportError:
        return _components_bfs(mask)
    labels, _ = ndimage.label(mask, structure=np.ones((3, 3), dtype=bool))
    result = []
    for label, piece in enumerate(ndimage.find_objects(labels), start=1):
        if piece is None:
            continue
        ys, xs = np.nonzero(labels[piece] == label)
        result.append((ys + piece[0].start, xs + piece[1].start))
    return result


def _components_bfs(mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    result = []
    for start_y, start_x in zip(*np.nonzero(mask)):
        if seen[start_y, start_x]:
            continue
        seen[start_y, start_x] = True
        queue = deque([(int(start_y), int(start_x))])
        ys, xs = [], []
        while queue:
            y, x = queue.popleft()
            ys.append(y)
            xs.append(x)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
        result.append((np.array(ys), np.array(xs)))
    return result


def iou_matrix(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """IoU of every box [x0, y0, x1, y1] of `ref` (rows) with every box of `cand` (columns)."""
    x0 = np.maximum(ref[:, None, 0], cand[None, :, 0])
    y0 = np.maximum(ref[:, None, 1], cand[None, :, 1])
    x1 = np.minimum(ref[:, None, 2], cand[None, :, 2])
    y1 = np.minimum(ref[:, None, 3], cand[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area_r = (ref[:, 2] - ref[:, 0]) * (ref[:, 3] - ref[:, 1])
    area_c = (cand[:, 2] - cand[:, 0]) * (cand[:, 3] - cand[:, 1])
    return np.asarray(inter / (area_r[:, None] + area_c[None, :] - inter))


def match_boxes(ref: np.ndarray, cand: np.ndarray) -> int:
    """True positives of a greedy one-to-one matching at IoU >= 0.5 (highest IoU first)."""
    if len(ref) == 0 or len(cand) == 0:
        return 0
    iou = iou_matrix(ref, cand)
    matched = 0
    used_r, used_c = set(), set()
    for flat in np.argsort(-iou, axis=None):
        r, c = divmod(int(flat), iou.shape[1])
        if iou[r, c] < IOU_MATCH:
            break
        if r not in used_r and c not in used_c:
            used_r.add(r)
            used_c.add(c)
            matched += 1
    return matched


class BoxF1:
    """Micro-averaged box F1 over a data set."""

    def __init__(self) -> None:
        self.tp = self.n_ref = self.n_cand = 0

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        self.tp += match_boxes(ref, cand)
        self.n_ref += len(ref)
        self.n_cand += len(cand)

    def result(self) -> float:
        total = self.n_ref + self.n_cand
        return 1.0 if total == 0 else 2 * self.tp / total


def truth_boxes(truth: dict[str, Any], map_hw: Sequence[int]) -> np.ndarray:
    """Rendered ink boxes scaled from page to probability-map coordinates."""
    page_h, page_w = truth["image_hw"]
    scale = np.array([map_hw[1] / page_w, map_hw[0] / page_h] * 2)
    return np.array(truth["boxes"], dtype=np.float64).reshape(-1, 4) * scale


# ----------------------------------------------------------------------------- rec


def ctc_greedy(probs: np.ndarray, characters: Sequence[str]) -> list[str]:
    """rapidocr's CTCLabelDecode: argmax per step, merge repeats, drop blank (index 0)."""
    return ["".join(characters[i] for i in row) for row in ctc_indices(probs)]


def ctc_indices(scores: np.ndarray) -> list[tuple[int, ...]]:
    """Greedy CTC on scores [N, T, classes] (probabilities or logits): per sample, the argmax of
    each step, repeats merged, blank (index 0) dropped."""
    rows = []
    for row in scores.argmax(axis=-1):
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        keep &= row != 0
        rows.append(tuple(int(i) for i in row[keep]))
    return rows


def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


# ----------------------------------------------------------------------------- coverage


def compute_coverage(model_path: Path, feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """Share of Conv/ConvTranspose/MatMul/Gemm work whose data and weight inputs come from DQ.

    Shapes come from ONNX shape inference with the input fixed to the shape of `feed` (one
    sample); tensors it cannot size (after Shape/Reshape arithmetic) are measured by running the
    model once on `feed` with them as extra outputs. MACs: Conv = |out| * |W[1:]|,
    ConvTranspose = |in| * |W[1:]|, MatMul/Gemm = |out| * K.
    """
    import onnx

    model = onnx.load(str(model_path))
    graph = model.graph
    initializers = {i.name: list(i.dims) for i in graph.initializer}
    first = next(i for i in graph.input if i.name not in initializers)
    input_shape = next(iter(feed.values())).shape
    for dim, size in zip(first.type.tensor_type.shape.dim, input_shape):
        dim.Clear()
        dim.dim_value = int(size)
    # Stale shapes (the exporter's -1 batch, unknown sizes) would win over inferred ones.
    del graph.value_info[:]
    for output in graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - missing shapes are measured below instead
        model.graph.ClearField("value_info")
    shapes: dict[str, list[int] | None] = dict(initializers)
    for vi in [*model.graph.value_info, *model.graph.output, *model.graph.input]:
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = (
            [d.dim_value if d.HasField("dim_value") else -1 for d in dims]
            if vi.type.tensor_type.HasField("shape")
            else None
        )
    producer = {out: node for node in model.graph.node for out in node.output}

    def shape(name: str) -> list[int] | None:
        found = shapes.get(name)
        if found is None and name in producer and producer[name].op_type == "DequantizeLinear":
            found = shapes.get(producer[name].input[0])
        return None if found is None or any(d <= 0 for d in found) else found

    compute = [
        n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm")
    ]
    missing = sorted({t for n in compute for t in (*n.input[:2], n.output[0]) if shape(t) is None})
    if missing:
        shapes.update(_measured_shapes(model_path, feed, missing))
    total = quantized = 0.0
    nodes = quantized_nodes = unknown = 0
    for node in model.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm"):
            continue
        nodes += 1
        is_quantized = all(
            i in producer and producer[i].op_type == "DequantizeLinear" for i in node.input[:2]
        )
        quantized_nodes += is_quantized
        macs = _macs(node, shape)
        if macs is None:
            unknown += 1
            continue
        total += macs
        quantized += macs * is_quantized
    return {
        "mac_fraction": quantized / total if total else None,
        "macs": total,
        "nodes": nodes,
        "quantized_nodes": quantized_nodes,
        "nodes_without_shape": unknown,
    }


def _measured_shapes(
    model_path: Path, feed: dict[str, np.ndarray], names: Sequence[str]
) -> dict[str, list[int]]:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(
        onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in known
    )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    wanted = [o.name for o in session.get_outputs() if o.name in set(names)]
    return {n: list(v.shape) for n, v in zip(wanted, session.run(wanted, feed))}


def _macs(node: Any, shape: Any) -> float | None:
    w = shape(node.input[1])
    if node.op_type == "ConvTranspose":
        x = shape(node.input[0])
        return None if x is None or w is None else float(np.prod(x) * np.prod(w[1:]))
    out = shape(node.output[0])
    if out is None:
        return None
    if node.op_type == "Conv":
        return None if w is None else float(np.prod(out) * np.prod(w[1:]))
    x = shape(node.input[0])
    if x is None:
        return None
    k = x[-1]
    if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
        k = x[0]
    return float(np.prod(out) * k)


# ----------------------------------------------------------------------------- running


def make_variants(
    model: BenchModel, calib: Path, args: argparse.Namespace, wanted: set[str]
) -> dict[str, Any]:
    """Quantize with onnxruntime (naive) and with each qcal invocation; record failures."""
    out = work_dir("eval_ppocr", model.name)
    logs = work_dir("eval_ppocr", model.name, "logs")
    variants: dict[str, Any] = {"float": {"path": model.path, "ok": True}}
    if ORT_NAIVE in wanted:
        variants[ORT_NAIVE] = _ort_naive(model, calib, args, out, logs)
    for name, per_task in QCAL_VARIANTS.items():
        if name in wanted:
            variants[name] = _qcal_variant(
                model, calib, args, out / name.replace(" ", "-"), logs, per_task.get(model.task, [])
            )
    for name, variant in variants.items():
        status = "ok" if variant["ok"] else f"failed: {variant['error']}"
        print(f"[quantize] {model.name} {name}: {status}", flush=True)
    return variants


def _ort_naive(
    model: BenchModel, calib: Path, args: argparse.Namespace, out: Path, logs: Path
) -> dict[str, Any]:
    job = ort_job(model, "MinMax", calib, out / "ort-naive.onnx")
    result = run_worker(job, logs, "ort", args)
    return {
        "path": Path(job["output"]),
        "ok": result.ok,
        "error": result.error,
        "seconds": result.wall_seconds,
    }


def _qcal_variant(
    model: BenchModel,
    calib: Path,
    args: argparse.Namespace,
    stem: Path,
    logs: Path,
    extra: list[str],
) -> dict[str, Any]:
    """`qcal calibrate` as a subprocess; the report's coverage and fallback sections are kept."""
    output, report = stem.with_suffix(".qdq.onnx"), stem.with_suffix(".qcal.json")
    cmd = qcal_cli_cmd(
        model.path, calib, output, report, method=None, batch_size=1, eval_data=None, extra=extra
    )
    result = run_child(
        cmd, log_stem=logs / stem.name, timeout_s=args.timeout, max_rss_mib=args.max_rss_mib
    )
    variant: dict[str, Any] = {
        "path": output,
        "ok": result.ok,
        "error": result.error,
        "seconds": result.wall_seconds,
        "command": cmd[1:],
        "report": report if result.ok else None,
    }
    if result.ok and report.is_file():
        data = json.loads(report.read_text())
        variant["qcal_report"] = {
            k: v for k, v in data.items() if k in ("coverage", "timings_seconds") or "fallback" in k
        }
    return variant


def evaluate(
    model: BenchModel, variants: dict[str, Any], eval_path: Path, truths: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    sessions = variant_sessions(variants)
    characters = character_list(model.path) if model.task == "rec" else []
    stats: dict[str, dict[str, Any]] = {
        name: {
            "agreement": OutputAgreement(argmax=model.task in ("rec", "cls")),
            "f1_float": BoxF1(),
            "f1_truth": BoxF1(),
            "same": 0,
            "correct": 0,
            "edits": 0,
            "chars": 0,
            "n": 0,
        }
        for name in sessions
    }
    first_feed = None
    for feed, truth in zip(iter_samples(eval_path, model.input_name), truths):
        first_feed = first_feed or feed
        ref = sessions["float"].run(None, feed)[0]
        ref_view = _task_view(model, ref, characters)
        for name, session in sessions.items():
            out = ref if name == "float" else session.run(None, feed)[0]
            view = ref_view if name == "float" else _task_view(model, out, characters)
            s = stats[name]
            s["agreement"].update(ref, out)
            s["n"] += 1
            if model.task == "det":
                s["f1_float"].update(ref_view, view)
                s["f1_truth"].update(truth_boxes(truth, ref.shape[2:]), view)
            elif model.task == "rec":
                # the margins and padding decode as leading/trailing spaces: compare stripped
                text, ref_text = view[0].strip(), ref_view[0].strip()
                s["same"] += text == ref_text
                s["correct"] += text == truth["text"]
                s["edits"] += edit_distance(text, ref_text)
                s["chars"] += max(1, len(ref_text))
            else:
                s["same"] += int(view[0] == ref_view[0])
                s["correct"] += int(view[0] == truth["label"])
    results = {}
    for name, s in stats.items():
        row: dict[str, Any] = {"samples": s["n"], "outputs": s["agreement"].result()}
        if model.task == "det":
            row["task_vs_float"] = s["f1_float"].result()
            row["task_vs_truth"] = s["f1_truth"].result()
            row["measure"] = "box F1"
        else:
            row["task_vs_float"] = s["same"] / max(1, s["n"])
            row["task_vs_truth"] = s["correct"] / max(1, s["n"])
            row["measure"] = "string agreement" if model.task == "rec" else "direction agreement"
            if model.task == "rec":
                row["cer_vs_float"] = s["edits"] / max(1, s["chars"])
        row["coverage"] = (
            None if name == "float" else compute_coverage(variants[name]["path"], first_feed)
        )
        results[name] = row
    return results


def _task_view(model: BenchModel, out: np.ndarray, characters: Sequence[str]) -> Any:
    if model.task == "det":
        return db_boxes(out[0, 0])
    if model.task == "rec":
        return ctc_greedy(out, characters)
    return [int(i) for i in out.argmax(axis=-1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="ppocr_det,ppocr_rec,ppocr_cls")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument(
        "--variants",
        default=",".join([ORT_NAIVE, *QCAL_VARIANTS]),
        help="which quantized variants to make (comma-separated)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--max-rss-mib", type=float, default=default_max_rss_mib())
    parser.add_argument("--no-install", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="8 calibration and 8 evaluation samples"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.calib_samples, args.eval_samples = 8, 8
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
    try:
        models = get_models(
            [m.strip() for m in args.models.split(",")], install=not args.no_install
        )
    except BenchmarkSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "machine": machine_info(),
        "args": vars(args),
        "qcal_variants": QCAL_VARIANTS,
        "models": {},
    }
    rows = []
    for model in models:
        calib, eval_path = model.calib_data(args.calib_samples), model.eval_data(args.eval_samples)
        truths = model.truth("eval", args.eval_samples)
        variants = make_variants(model, calib, args, wanted)
        results = evaluate(model, variants, eval_path, truths)
        report["models"][model.name] = {"variants": variants, "results": results}
        for name, variant in variants.items():
            row = results.get(name)
            if row is None:
                rows.append(
                    [
                        model.name,
                        name,
                        None,
                        None,
                        None,
                        None,
                        None,
                        f"failed: {variant['error']}"[:70],
                    ]
                )
                continue
            cov = row["coverage"] or {}
            rows.append(
                [
                    model.name,
                    name,
                    row["measure"],
                    row["task_vs_float"],
                    row["task_vs_truth"],
                    row["outputs"]["sqnr_db"] if name != "float" else None,
                    _pct(cov.get("mac_fraction")) if name != "float" else None,
                    "ok",
                ]
            )
    print_table(
        f"PP-OCR task agreement, float vs quantized ({args.calib_samples} calibration, "
        f"{args.eval_samples} evaluation samples)",
        [
            "model",
            "variant",
            "measure",
            "vs float",
            "vs truth",
            "SQNR dB",
            "MACs quantized",
            "status",
        ],
        rows,
    )
    path = write_results("eval_ppocr", report)
    print(f"\nJSON: {path}")
    return 0


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
