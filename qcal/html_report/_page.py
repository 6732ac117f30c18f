"""The page: one HTML file with its style, its plots (inline SVG) and a few lines of script for
the tensor table's filter and sort; nothing is fetched from anywhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import PurePath
from typing import Any

from qcal._verdict import (
    agreement_cell,
    other_warnings,
    padding_words,
    quality_verdict,
    sqnr_cell,
)
from qcal.accuracy.gates import GateResult
from qcal.html_report._plots import fallback_svg, histogram_svg, sensitivity_svg
from qcal.html_report._tensors import TensorView, tensor_views
from qcal.report import reasons_by_kind

__all__ = ["MAX_HISTOGRAM_PLOTS", "MAX_SENSITIVITY_BARS", "page"]

MAX_HISTOGRAM_PLOTS = 40
MAX_SENSITIVITY_BARS = 30

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1100px;
padding:0 18px 40px;color:#222}
h1{font-size:22px;margin:18px 0 6px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3;cursor:default}.num{text-align:right;font-variant-numeric:tabular-nums}
#tensor-table th{cursor:pointer}#tensor-table tr:nth-child(even){background:#fafafa}
.facts th{background:none;color:#555;font-weight:normal;padding-left:0}
.verdict{padding:8px 12px;border-radius:4px;margin:10px 0;font-weight:600}
.v-ok{background:#e8f6ec;border-left:5px solid #27ae60}.v-bad{background:#fdecea;border-left:5px solid #c0392b}
.v-none{background:#f3f3f3;border-left:5px solid #999}.warn{color:#9a6700}.bad{color:#c0392b}
.note{color:#555}.plot{margin:10px 0}svg{max-width:100%;height:auto}code{font-size:13px}
"""

_SCRIPT = """
(function () {
  var table = document.getElementById("tensor-table");
  var text = document.getElementById("tensor-filter");
  var role = document.getElementById("tensor-role");
  var shown = document.getElementById("tensor-shown");
  var rows = Array.prototype.slice.call(table.tBodies[0].rows);
  function filter() {
    var wanted = text.value.toLowerCase(), which = role.value, count = 0;
    rows.forEach(function (row) {
      var keep = row.dataset.name.indexOf(wanted) >= 0 && (!which || row.dataset.role === which);
      row.hidden = !keep;
      if (keep) { count += 1; }
    });
    shown.textContent = String(count);
  }
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (cell, column) {
    cell.addEventListener("click", function () {
      var down = cell.dataset.order !== "down";
      cell.dataset.order = down ? "down" : "up";
      rows.sort(function (a, b) {
        var x = a.cells[column].dataset.v, y = b.cells[column].dataset.v;
        var order = (x !== undefined && y !== undefined) ? Number(x) - Number(y)
          : a.cells[column].textContent.localeCompare(b.cells[column].textContent);
        return down ? order : -order;
      });
      rows.forEach(function (row) { table.tBodies[0].appendChild(row); });
    });
  });
  text.addEventListener("input", filter);
  role.addEventListener("change", filter);
  // page.html#filter=conv1 opens the page filtered (a link to some tensors)
  var asked = /[#&]filter=([^&]*)/.exec(window.location.hash);
  if (asked) { text.value = decodeURIComponent(asked[1]); }
  filter();
  document.body.dataset.ready = "1";
})();
"""


def _fmt(value: float | None, spec: str, none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _row(cells: Sequence[str], *, header: bool = False) -> str:
    tag = "th" if header else "td"
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def _float_reasons(by_reason: Mapping[str, int]) -> dict[str, int]:
    """The fallback's per-tensor reasons folded into one (the Fallback section lists them),
    and those differing only in the names they quote."""
    folded: dict[str, int] = {}
    for reason, count in reasons_by_kind(by_reason).items():
        if "by the accuracy fallback" in reason:
            reason = "kept float by the accuracy fallback (see Fallback)"
        folded[reason] = folded.get(reason, 0) + count
    return folded


def _facts(report: Mapping[str, Any]) -> str:
    data, cov, preset = report["data"], report["coverage"], report["preset"]
    model = (f"<code>{escape(report['input_model']['path'])}</code> "
             f"(sha256 {report['input_model']['sha256'][:12]}…)")
    rows = [("model", model)]
    out = report["output_model"]
    if out is not None:
        rows.append(("quantized model",
                     f"<code>{escape(out['path'])}</code>, {out['size_bytes']:,} bytes"))
    method = escape(str(report["config"]["method"]))
    rows.append(("preset", f"{escape(preset['name'])}, method {method}"))
    where = "" if data["path"] is None else f" <code>{escape(data['path'])}</code>"
    synthetic = ' <span class="bad">SYNTHETIC random data</span>' if data["synthetic"] else ""
    samples = f"{data['samples']} samples{synthetic}"
    rows.append(("calibration data", f"{escape(data['kind'])}{where}: {samples}"))
    evaluation = report["evaluation"]
    if evaluation:
        where = escape(evaluation["data"])
        rows.append(("evaluated on", f"{where}, {evaluation['samples']} samples"
                     + escape(padding_words(evaluation.get("padding")))))
    coverage = f"{cov['quantized']} of {cov['nodes']} nodes quantized"
    if "macs_quantized_fraction" in cov:
        unit = "MACs" if cov["basis"] == "macs" else "compute nodes"
        coverage += (f"; {cov['macs_quantized_fraction']:.1%} of Conv/MatMul/Gemm {unit} "
                     f"({cov['quantized_compute_nodes']} of {cov['compute_nodes']} nodes)")
    rows.append(("coverage", coverage))
    if cov["skipped_by_reason"]:
        reasons = sorted(_float_reasons(cov["skipped_by_reason"]).items(),
                         key=lambda kv: (-kv[1], kv[0]))
        rows.append(("kept float", "<br>".join(f"{n} × {escape(r)}" for r, n in reasons[:8])
                     + ("<br>…" if len(reasons) > 8 else "")))
    rows.append(("tensors", f"{len(report['tensors'])} quantized tensors"))
    return '<table class="facts">' + "".join(
        f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _outputs(report: Mapping[str, Any]) -> str:
    evaluation = report["evaluation"]
    if not evaluation:
        return '<p class="note">Not evaluated: no comparison with the float model.</p>'
    head = ["output", "SQNR dB", "cosine", "max |err|", "top-1 agree", "acc float", "acc quant"]
    body = [
        "<tr>" + f"<td>{escape(o['name'])}</td>" + "".join(
            f'<td class="num">{v}</td>' for v in (
                sqnr_cell(o), _fmt(o["cosine"], ".5f"),
                _fmt(o["max_abs_error"], ".4g"), agreement_cell(o),
                _fmt(o["float_accuracy"], ".2%"), _fmt(o["quantized_accuracy"], ".2%"))) + "</tr>"
        for o in evaluation["outputs"]
    ]
    return f"<table>{_row(head, header=True)}{''.join(body)}</table>"


def _timings(timings: Mapping[str, float]) -> str:
    """Machine timings: the one part of the page that differs between identical runs."""
    parts = []
    for threads in ("1_thread", "2_threads"):
        float_s = timings.get(f"latency_float_{threads}")
        quant_s = timings.get(f"latency_quantized_{threads}")
        if float_s and quant_s is not None:
            parts.append(f"at {threads.replace('_', ' ')}: quantized {1000 * quant_s:.3g} ms, "
                         f"float {1000 * float_s:.3g} ms ({quant_s / float_s:.2f}x)")
    latency = ("latency on the calibrating machine " + "; ".join(parts)) if parts else \
        "latency not measured"
    stages = ", ".join(f"{escape(k)} {v:.2f} s" for k, v in timings.items()
                       if not k.startswith("latency_"))
    return f'<div id="timings"><p>{latency}.</p><p class="note">run time: {stages}</p></div>'


def _summary(report: Mapping[str, Any]) -> str:
    verdict = quality_verdict(report)
    if verdict is None:
        banner = '<div class="verdict v-none">quality: not measured</div>'
    else:
        fallback = report.get("fallback")
        failed = any(not g["passed"] for g in report["gates"]) or (
            fallback is not None and not fallback["reached"])
        style = "v-bad" if failed or not verdict.ok else (
            "v-ok" if verdict.level == "within-floor" else "v-none")
        said = verdict.text
        if fallback is not None and not fallback["reached"]:
            said += " — the fallback's target was not reached (see Fallback)"
        gates_failed = sum(not g["passed"] for g in report["gates"])
        if gates_failed:
            said += f" — {gates_failed} gate(s) failed"
        banner = f'<div class="verdict {style}">{escape(said)}</div>'
    gates = "".join(  # worded as the terminal's "gate:" lines
        f'<li class="{"" if g["passed"] else "bad"}">{escape(g["option"])}: '
        f'{escape(GateResult(**g).describe())}</li>'
        for g in report["gates"])
    warnings = "".join(f'<li class="warn">{escape(w)}</li>' for w in other_warnings(report))
    return (f'<section id="summary"><h2>Summary</h2>{banner}{_facts(report)}'
            f"<h3>Float vs quantized outputs</h3>{_outputs(report)}"
            + (f"<h3>Gates</h3><ul>{gates}</ul>" if gates else "")
            + (f"<h3>Warnings</h3><ul>{warnings}</ul>" if warnings else "")
            + f"<h3>Speed</h3>{_timings(report['timings_seconds'])}</section>")


def _histograms(views: Sequence[TensorView]) -> str:
    with_histogram = [v for v in views if v.entry.get("histogram") is not None]
    intro = ('<section id="histograms"><h2>Histograms, worst tensors first</h2>'
             '<p class="note">Each activation\'s values (counts on a log scale), the range chosen '
             "(red lines), what the quantization grid represents (green band) and the ranges "
             "the percentile method would choose (grey dashes). ")
    if not with_histogram:
        return intro + ("No histogram is stored for this run: histograms are kept for tensors "
                        "calibrated with a histogram method (the default <code>auto</code>, "
                        "<code>percentile</code>, <code>entropy</code> or <code>mse</code>); "
                        "every tensor's range is in "
                        "the table below.</p></section>")
    drawn = with_histogram[:MAX_HISTOGRAM_PLOTS]
    intro += (f"Showing {len(drawn)} of {len(with_histogram)} tensors with a stored histogram"
              + (f" (at most {MAX_HISTOGRAM_PLOTS} are drawn; all are in the table below)"
                 if len(drawn) < len(with_histogram) else "") + ".</p>")
    plots = []
    for number, view in enumerate(drawn):
        entry = view.entry
        chosen = (float(entry["range"]["min"][0]), float(entry["range"]["max"][0]))
        clipped = entry["range"].get("clipped_fraction", [None])[0]
        title = (f"{entry['name']} ({entry['method']}; clipped {_fmt(clipped, '.3%')}; "
                 f"local SQNR {_fmt(view.sqnr_db, '.1f')} dB{'' if view.sqnr_measured else ' est.'})")
        plots.append(f'<div class="plot" data-tensor="{escape(view.name)}">'
                     f"{histogram_svg(number, title, entry['histogram'], chosen, view.grid)}</div>")
    return intro + "".join(plots) + "</section>"


def _sensitivity(report: Mapping[str, Any], number: int) -> str:
    head = '<section id="sensitivity"><h2>Sensitivity</h2>'
    sensitivity = report.get("sensitivity")
    if not sensitivity:
        return head + ('<p class="note">Not measured: <code>qcal calibrate --sensitivity</code> '
                       "measures each tensor's effect on the outputs.</p></section>")
    if sensitivity.get("method") == "error-jump":
        rows = [(r["tensor"], float(r["noise_ratio"])) for r in sensitivity["tensors"]
                if r["noise_ratio"] is not None]
        label = "error jump where the tensor is read (noise/signal; higher is worse)"
        what = "where the error of the quantized model jumps, measured in two passes"
    else:
        rows = [(r["tensor"], float(r["output_sqnr_db"])) for r in sensitivity["tensors"]
                if r["output_sqnr_db"] is not None]
        label = "worst output SQNR dB with this tensor alone quantized (lower is worse)"
        what = "each tensor quantized alone"
    shown = rows[:MAX_SENSITIVITY_BARS]
    note = (f'<p class="note">{what}, on {sensitivity["samples"]} samples '
            f"({escape(sensitivity['data'])}); the {len(shown)} worst of "
            f"{len(sensitivity['tensors'])} tensors.</p>")
    if not shown:
        return head + note + "<p>Every tensor leaves the outputs unchanged.</p></section>"
    return head + note + f'<div class="plot">{sensitivity_svg(number, shown, label)}</div></section>'


def _fallback(report: Mapping[str, Any], number: int) -> str:
    head = '<section id="fallback"><h2>Fallback: quality against coverage</h2>'
    fallback, config = report.get("fallback"), report["config"]
    if not fallback:
        why = ("it was turned off (<code>--no-fallback</code>)" if not config["fallback"] else
               "the fully quantized model met the accuracy target")
        return head + f'<p class="note">Nothing was kept float by the fallback: {why}.</p></section>'
    style = "" if fallback["reached"] else ' class="bad"'
    parts = [head, f"<p{style}>{escape(fallback['message'])}</p>"]
    steps = fallback["steps"]
    # the measure the fallback worked towards: the target asked for, else the floor's own
    agreement = not config.get("target_sqnr") and (
        config.get("max_agreement_drop") is not None
        or all(s["worst_top1_agreement"] is not None for s in steps))
    key = "worst_top1_agreement" if agreement else "worst_sqnr_db"
    points = [(100 * s["macs_quantized_fraction"], s[key] * (100 if agreement else 1),
               bool(s["target_met"])) for s in steps if s[key] is not None]
    chosen = next((i for i, s in enumerate(s for s in steps if s[key] is not None)
                   if s["kept_float"] == len(fallback["kept_float"])), None)
    if agreement:
        drop = config.get("max_agreement_drop")
        target, label = (100 - drop if drop is not None else 99.0), "worst top-1 agreement %"
    else:
        target, label = (config.get("target_sqnr") or 10.0), "worst output SQNR dB"
    if points:
        parts.append(f'<div class="plot">{fallback_svg(number, points, chosen, label, target)}</div>')
    if fallback["kept_float"]:
        parts.append("<h3>Kept float</h3><ul>" + "".join(
            f"<li><code>{escape(k['tensor'])}</code>: {escape(k['reason'])}</li>"
            for k in fallback["kept_float"]) + "</ul>")
    return "".join(parts) + "</section>"


def _range_cell(entry: Mapping[str, Any]) -> str:
    rng = entry.get("range")
    if rng is None:
        return "–"
    low, high = min(rng["min"]), max(rng["max"])
    return f"[{low:.4g}, {high:.4g}]" + (f" ×{len(rng['min'])}" if len(rng["min"]) > 1 else "")


def _method(entry: Mapping[str, Any]) -> str:
    """The range method, and how weight codes were rounded when not to nearest (GPTQ)."""
    rounding = entry.get("rounding")
    if not rounding:
        return str(entry["method"])
    return (f"{entry['method']}, {rounding['method']} (output error {rounding['output_error']:.3g}"
            f" vs {rounding['output_error_nearest']:.3g} nearest)")


def _number_cell(sort_value: float, text: str) -> str:
    return f'<td class="num" data-v="{sort_value!r}">{text}</td>'


def _table(views: Sequence[TensorView]) -> str:
    head = ["tensor", "role", "method", "type", "range", "scale", "zero point", "clipped",
            "SQNR dB", "rank"]
    body = []
    for view in sorted(views, key=lambda v: v.name):
        entry, onnx = view.entry, view.entry["onnx"]
        scales = onnx["scale"]
        scale = f"{scales[0]:.4g}" if len(scales) == 1 else f"{min(scales):.3g}…{max(scales):.3g}"
        zeros = onnx["zero_point"]
        zero = str(zeros[0]) if len(set(zeros)) == 1 else f"{min(zeros)}…{max(zeros)}"
        clipped = (entry.get("range") or {}).get("clipped_fraction", [None])[0]
        sqnr = "–" if view.sqnr_db is None else \
            f"{view.sqnr_db:.1f}" + ("" if view.sqnr_measured else " est.")
        cells = [
            f"<td>{escape(view.name)}</td>", f"<td>{escape(entry['role'])}</td>",
            f"<td>{escape(_method(entry))}</td>", f"<td>{escape(onnx['type'])}</td>",
            f"<td>{_range_cell(entry)}</td>",
            f'<td class="num" data-v="{min(scales)!r}">{scale}</td>',
            f'<td class="num">{zero}</td>',
            _number_cell(-1 if clipped is None else clipped, _fmt(clipped, ".3%")),
            _number_cell(1e9 if view.sqnr_db is None else round(view.sqnr_db, 3), sqnr),
            f'<td class="num" data-v="{view.rank}">{view.rank + 1}</td>',
        ]
        body.append(f'<tr data-name="{escape(view.name.lower())}" data-role="{escape(entry["role"])}">'
                    + "".join(cells) + "</tr>")
    roles = sorted({v.entry["role"] for v in views})
    controls = ('<p><input id="tensor-filter" type="search" placeholder="filter by name" '
                'aria-label="filter by name"> <select id="tensor-role" aria-label="role">'
                '<option value="">every role</option>'
                + "".join(f'<option value="{escape(r)}">{escape(r)}</option>' for r in roles)
                + f'</select> <span id="tensor-shown">{len(views)}</span> of {len(views)} shown; '
                "click a column to sort. SQNR: measured alone with --sensitivity, otherwise "
                "estimated from the stored histogram (est.).</p>")
    return ('<section id="tensors"><h2>Tensors</h2>' + controls
            + f'<table id="tensor-table"><thead>{_row(head, header=True)}</thead>'
            + f"<tbody>{''.join(body)}</tbody></table></section>")


def page(report: Mapping[str, Any]) -> str:
    views = tensor_views(report)
    model = PurePath(report["input_model"]["path"]).name
    sections = [
        _summary(report),
        _histograms(views),
        _sensitivity(report, MAX_HISTOGRAM_PLOTS),
        _fallback(report, MAX_HISTOGRAM_PLOTS + 1),
        _table(views),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>qcal report: {escape(model)}</title><style>{_STYLE}</style></head>"
        f"<body><h1>qcal report: {escape(model)}</h1>"
        + "\n".join(sections)
        + f'<footer class="note"><p>qcal {escape(report["versions"]["qcal"])}, report schema '
        f'{report["schema_version"]}.</p></footer><script>{_SCRIPT}</script></body></html>\n'
    )
