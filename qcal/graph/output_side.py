"""The output side of a model: the tensors its outputs read through no layer that mixes values.

A range that clips one of these tensors clips the model's outputs themselves: the largest
logit of a classifier (its decision then ties with the next), a box coordinate, an embedding's
largest components. Behind a Conv/MatMul/Gemm, a clipped tail is one error among the many the
layer sums, which a range's squared error weighs; in front of the outputs it is the result.
"""

from __future__ import annotations

import onnx

from qcal.graph.integer_kernels import ANCHOR_OPS
from qcal.graph.structure import UseIndex

__all__ = ["output_side_tensors"]


def output_side_tensors(graph: onnx.GraphProto) -> frozenset[str]:
    """The main graph's outputs and every tensor they read back to the nearest
    Conv/ConvTranspose/MatMul/Gemm (whose outputs are included, not their inputs)."""
    return UseIndex.build(graph).upstream((output.name for output in graph.output),
                                          through=lambda node: node.op_type not in ANCHOR_OPS)
