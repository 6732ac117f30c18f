"""What every preparation pass returns, and the protocol they share (STYLE.md §1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import onnx

__all__ = ["IR_INITIALIZERS_WITHOUT_INPUTS", "PrepPass", "StepResult"]

# IR versions below 4 require every initializer to be listed as a graph input too.
IR_INITIALIZERS_WITHOUT_INPUTS = 4


@dataclass(frozen=True)
class StepResult:
    """The outcome of one preparation pass.

    Attributes:
        model: the rewritten model (the same object the pass was given, unless it had to build
            a new one, as opset conversion does).
        modified: whether the pass changed anything.
        detail: one human sentence saying what it did ("folded 3 BatchNormalization into
            Conv"), or why it could not ("shape inference could not complete: ..."); empty when
            there is nothing to say.
    """

    model: onnx.ModelProto
    modified: bool
    detail: str = ""


class PrepPass(Protocol):
    """A graph rewrite with one job.

    A pass may rewrite the model it is given in place (the caller owns that copy). It checks what
    it relies on and raises `qcal.numerics.errors.ModelError` when the model cannot be prepared.
    """

    name: ClassVar[str]

    def __call__(self, model: onnx.ModelProto) -> StepResult: ...
