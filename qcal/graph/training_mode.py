"""A model exported for training rather than inference (torch.onnx's `training=TRAINING`, or a
module left in train mode): its Dropout nodes drop values at random on every run, and its
BatchNormalization nodes normalize by each batch's own statistics.

Random outputs leave nothing to calibrate against: two runs of the float model on the same
sample differ, the figures and the model qcal writes would differ from run to run, and the
model is not the one the user deploys. So such a Dropout is refused, naming it. Batch statistics
are deterministic (a sample's own, at batch 1) and some models mean them (a generator normalizing
each image by itself), so they are only said (a digits CNN exported so agreed with its eval-mode
export on 98.8 % of digits, not 99.5 %).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.names import first_and_more
from qcal.graph.structure import DEFAULT_DOMAINS, int_attribute
from qcal.numerics.errors import ModelError

__all__ = ["batch_statistics_note", "refuse_random_dropout"]


def refuse_random_dropout(graph: onnx.GraphProto) -> None:
    """Raise ModelError naming the main graph's Dropout nodes whose training_mode input is a
    constant true (module docstring)."""
    constants = {t.name: t for t in graph.initializer}
    constants.update({n.output[0]: a.t for n in graph.node
                      if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and n.output
                      for a in n.attribute if a.name == "value" and a.type == a.TENSOR})
    inputs = {v.name for v in graph.input}
    random = [n.name or n.output[0] for n in graph.node
              if n.op_type == "Dropout" and n.domain in DEFAULT_DOMAINS and len(n.input) > 2
              and n.input[2] in constants and n.input[2] not in inputs
              and bool(np.any(numpy_helper.to_array(constants[n.input[2]])))]
    if random:
        raise ModelError(
            f"Dropout {first_and_more(random)} runs in training mode (its training_mode input is "
            "true): it drops values at random on every run, so nothing can be calibrated "
            "against it; export the model for inference (in PyTorch: model.eval(), and "
            "torch.onnx.export(..., training=torch.onnx.TrainingMode.EVAL))")


def batch_statistics_note(graph: onnx.GraphProto) -> str | None:
    """What to tell of the main graph's BatchNormalization nodes in training mode (module
    docstring), or None."""
    nodes = [n.name or n.output[0] for n in graph.node
             if n.op_type == "BatchNormalization" and n.domain in DEFAULT_DOMAINS
             and int_attribute(n, "training_mode", 0)]
    if not nodes:
        return None
    return (f"BatchNormalization {first_and_more(nodes)} in training mode: it normalizes by each "
            "batch's own statistics, not the running ones, so the model computes what it did "
            "in training (exported with torch.onnx.TrainingMode.TRAINING, or a module left in "
            "train mode?); qcal calibrates and compares it as it is")
