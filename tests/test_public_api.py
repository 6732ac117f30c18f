"""The public API is listed once, in qcal/__init__.py, and every listed name exists."""

from __future__ import annotations

import qcal


def test_every_public_name_exists_and_is_listed_once() -> None:
    assert len(qcal.__all__) == len(set(qcal.__all__))
    missing = [name for name in qcal.__all__ if not hasattr(qcal, name)]
    assert missing == []


def test_the_entry_points_are_public() -> None:
    for name in ("calibrate", "CalibrationConfig", "build_preset", "compute_qparams",
                 "fake_quantize", "to_onnx_qparams", "compare_models", "QcalError"):
        assert name in qcal.__all__


def test_library_calibrate_without_writing(tmp_path: object) -> None:
    from pathlib import Path

    model = Path(__file__).resolve().parents[1] / "sample_models" / "transformer_block.onnx"
    result = qcal.calibrate(model, qcal.CalibrationConfig(min_product_macs=0, limit=8))
    assert result.output is None and result.report["output_model"] is None
    assert result.comparison is not None and result.comparison.samples == 64
    kinds = {n.op_type for n in result.model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= kinds
