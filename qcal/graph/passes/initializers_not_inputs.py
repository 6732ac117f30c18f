"""Pass: stop listing initializers as graph inputs, so the weights they hold are constants."""

from __future__ import annotations

from typing import ClassVar

import onnx

from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult

__all__ = ["InitializersNotInputs"]


class InitializersNotInputs:
    """Drop the main graph's inputs that an initializer of the same name backs.

    IR 3 requires every initializer to be listed as a graph input too, and old exporters did so
    by default (PyTorch 1.x's keep_initializers_as_inputs, many model-zoo files). From IR 4 on
    such an input is a default a caller may override, so onnxruntime takes nothing it holds for
    a constant: it folds no BatchNorm into the Conv, fuses no bias, and a Resize whose scales
    are an empty initializer listed so fails to load once converted to opset 13. Nor can a
    weight that may be overridden be stored as integer codes: it would be quantized at every
    run, per tensor, as an activation is. A quantized model's weights are its codes, which no
    float input could replace: qcal quantizes the values the model holds, and its model no
    longer lists them as inputs. A model below IR 4 (kept at an opset that old by `--opset`)
    becomes IR 4, where they need not be.
    """

    name: ClassVar[str] = "initializers-not-inputs"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        initializers = {t.name for t in graph.initializer}
        kept = [v for v in graph.input if v.name not in initializers]
        dropped = len(graph.input) - len(kept)
        details = []
        if dropped:
            del graph.input[:]
            graph.input.extend(kept)
            details.append(f"{dropped} initializers no longer listed as graph inputs")
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:
            details.append(f"IR {model.ir_version} -> {IR_INITIALIZERS_WITHOUT_INPUTS}")
            model.ir_version = IR_INITIALIZERS_WITHOUT_INPUTS
        return StepResult(model, bool(details), ", ".join(details))
