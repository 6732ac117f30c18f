"""onnxruntime sessions for calibration and evaluation, built the same way everywhere."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from qcal.errors import ConfigError, ModelError

__all__ = ["available_providers", "create_session"]

# Protobuf cannot serialise a message of 2 GiB or more; such models go through a temp folder.
_MAX_INLINE_BYTES = 2**31 - 2**24


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def _session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: onnxruntime's warnings are not ours to print
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


def create_session(
    model: onnx.ModelProto,
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 0,
    what: str = "model",
) -> ort.InferenceSession:
    """Open `model` in onnxruntime; `what` names the model in error messages."""
    missing = [p for p in providers if p not in ort.get_available_providers()]
    if missing:
        raise ConfigError(
            f"provider: {', '.join(missing)} not available in this onnxruntime "
            f"(available: {', '.join(ort.get_available_providers())})"
        )
    options = _session_options(threads)
    try:
        if model.ByteSize() < _MAX_INLINE_BYTES:
            return ort.InferenceSession(
                model.SerializeToString(), sess_options=options, providers=list(providers)
            )
        with tempfile.TemporaryDirectory(prefix="qcal-") as tmp:
            path = Path(tmp) / "model.onnx"
            onnx.save_model(
                model, path, save_as_external_data=True, location="model.onnx.data",
                size_threshold=1024,
            )
            return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except (ort.capi.onnxruntime_pybind11_state.Fail,
            ort.capi.onnxruntime_pybind11_state.InvalidGraph,
            ort.capi.onnxruntime_pybind11_state.InvalidArgument,
            ort.capi.onnxruntime_pybind11_state.NotImplemented) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{what}: onnxruntime cannot load it: {first_line}") from None
