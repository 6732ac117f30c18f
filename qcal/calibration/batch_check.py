"""Whether joining samples into one onnxruntime run leaves every value the same.

`--batch-size` joins samples along the model's dim 0 to spread onnxruntime's per-node cost, and
qcal promises the same model and report whatever the batching. That holds only where onnxruntime
computes a sample in a batch exactly as it computes it alone. Its kernels pick their loops and
vector paths by shape, and some sum in another order at another batch size: on a JAX-exported
MLP-mixer a ReduceSum and the MatMul after it differ in their last bits between a batch of one and
of two, enough to move an activation's range by one ulp and the model's bytes with it. So before
joining, the float model runs on the first batch's samples alone and joined, with every float
tensor of its main graph exposed (but shape arithmetic, which counts the samples); any
difference and the samples run one at a time.

Values are compared as sorted lists, per tensor: a tensor whose batch axis is not first (a
Transpose to sequence-first for a recurrent layer) holds the same values in another layout,
which no range, histogram or sum sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from qcal.calibration.collect import expose_tensors
from qcal.calibration.data import DataSource, iter_batches
from qcal.calibration.runtime import create_session
from qcal.graph.model import InputSpec
from qcal.graph.placement import parameter_tensors
from qcal.graph.structure import UseIndex, default_opset, element_types

__all__ = ["exact_batch_size"]

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                     onnx.TensorProto.BFLOAT16})


def exact_batch_size(
    model: onnx.ModelProto, source: DataSource, inputs: Sequence[InputSpec], batch_size: int,
    *, providers: tuple[str, ...] = ("CPUExecutionProvider",), threads: int = 0,
) -> tuple[int, str | None]:
    """`batch_size`, or 1 with the reason when onnxruntime computes the first batch of `source`
    (its first `batch_size` samples, joined as `iter_batches` joins them) differently from its
    samples one at a time. Nothing runs when the batch size is 1 or the first batch holds one
    sample (the model's dim 0 is fixed, or the first samples differ in shape)."""
    if batch_size == 1:
        return 1, None
    joined, n = next(iter(iter_batches(source, inputs, batch_size)), ({}, 0))
    if n < 2:
        return batch_size, None
    types = element_types(model.graph)
    # Shape arithmetic (a Cast of a Shape, scaled on its way to a Resize) counts the samples: it
    # differs by design and is never observed.
    parameters = parameter_tensors(model.graph, UseIndex.build(model.graph),
                                   default_opset(model) or 1)
    # In graph order: the first tensor that differs is named, not one downstream of it.
    tensors = list(dict.fromkeys(value for node in model.graph.node for value in node.output
                                 if types.get(value) in _FLOATS and value not in parameters))
    session = create_session(expose_tensors(model, tensors), providers=providers,
                             threads=threads, what="model (batch check)")
    outputs = {o.name for o in session.get_outputs()}
    names = [t for t in tensors if t in outputs]
    together = session.run(names, joined)
    alone = [session.run(names, {k: v[i:i + 1] for k, v in joined.items()}) for i in range(n)]
    for position, name in enumerate(names):
        if not _same_values(together[position], [arrays[position] for arrays in alone]):
            return 1, (f"batch-size: onnxruntime computes tensor {name!r} differently for "
                       f"{n} samples joined than for one at a time; the samples ran one at a "
                       "time, so that the results do not depend on the batching")
    return batch_size, None


def _same_values(joined: np.ndarray, alone: list[np.ndarray]) -> bool:
    whole = np.concatenate([np.ravel(a) for a in alone])
    flat = np.ravel(joined)
    if flat.shape != whole.shape or flat.dtype != whole.dtype:
        return False
    if flat.dtype.kind != "f":
        return bool(np.array_equal(np.sort(flat), np.sort(whole)))
    # Bit patterns, sorted: equal values with equal signs and NaNs alike.
    bits = np.dtype(f"u{flat.dtype.itemsize}")
    return bool(np.array_equal(np.sort(flat.view(bits)), np.sort(whole.view(bits))))

