"""Whether joining samples into one onnxruntime run leaves every value the same.

`--batch-size` joins samples along the model's dim 0 to spread onnxruntime's per-node cost, and
qcal promises the same model and report whatever the batching. That holds only where onnxruntime
computes a sample in a batch exactly as it computes it alone. Its kernels pick their loops and
vector paths by shape, and some sum in another order at another batch size: on a JAX-exported
MLP-mixer a ReduceSum and the MatMul after it differ in their last bits between a batch of one and
of two, enough to move an activation's range by one ulp and the model's bytes with it. So before
joining, the float model runs on the first batches' samples alone and joined, with every float
tensor of its main graph exposed (but shape arithmetic, which counts the samples, and constants
computed in the graph); any difference and the samples run one at a time.

A tensor whose samples are stacked on dim 0 is compared sample by sample; any other (a Transpose
to sequence-first for a recurrent layer) as a sorted list of its values: the same values in
another layout, which no range, histogram or sum sees.

The thread count is checked the same way (`exact_threads`): onnxruntime splits some kernels'
sums between its threads (a 1-D Conv of a wav2vec2 feature encoder differs in its last bits at
one thread and at two), so the first sample runs at the thread count asked for and at one
thread, and any difference has the statistics passes run at one thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import islice
from typing import Any

import numpy as np
import onnx

from qcal.calibration.collect import expose_tensors
from qcal.calibration.data import DataSource, Feed, iter_batches, unjoinable_input
from qcal.calibration.runtime import create_session
from qcal.graph.model import InputSpec
from qcal.graph.parameters import parameter_tensors
from qcal.graph.shapes import static_shapes
from qcal.graph.structure import (
    UseIndex,
    default_opset,
    element_types,
    subgraph_reads,
)

__all__ = ["exact_batch_size", "exact_threads"]

_ITEM_BYTES: dict[int, int] = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2,
                               onnx.TensorProto.DOUBLE: 8, onnx.TensorProto.BFLOAT16: 2}
_FLOATS = frozenset(_ITEM_BYTES)
# The joined run's tensors, all alive at once (and one sample's run beside them): beyond this,
# samples run one at a time unchecked. A model whose tensors for a batch take this much spends
# its time in its kernels, not in the per-run cost that joining saves.
_CHECK_BYTES = 256 << 20
# Batches compared: whether a kernel's sum order shows depends on the values too (a JAX MLP's
# softmax sums agreed on its first batch of four and differed on the next four). Each costs a
# run per sample with every tensor exposed, which is what joining was to save.
_BATCHES_CHECKED = 2


def exact_batch_size(
    model: onnx.ModelProto, source: DataSource, inputs: Sequence[InputSpec], batch_size: int,
    *, providers: tuple[str, ...] = ("CPUExecutionProvider",), threads: int = 0,
) -> tuple[int, str | None]:
    """`batch_size`, or 1 with the reason when onnxruntime computes one of the first
    _BATCHES_CHECKED batches of `source` (joined as `iter_batches` joins them) differently from
    their samples one at a time, or when the check would hold more than _CHECK_BYTES of them.
    Nothing runs when the batch size is 1, when an input's dim 0 is fixed or missing (1 and
    the reason), or when no such batch holds two samples (they differ in shape)."""
    if batch_size == 1:
        return 1, None
    if (unjoinable := unjoinable_input(inputs)) is not None:
        return 1, f"batch-size: {unjoinable}; the samples ran one at a time"
    batches = [(feed, n) for feed, n in islice(iter_batches(source, inputs, batch_size),
                                               _BATCHES_CHECKED) if n > 1]
    if not batches:
        return batch_size, None
    tensors = _checked_tensors(model)
    n = max(n for _, n in batches)
    if max(_estimated_bytes(model, tensors, feed) for feed, _ in batches) > _CHECK_BYTES:
        return 1, (f"batch-size: the check that {n} samples joined compute as one at a time "
                   f"would hold over {_CHECK_BYTES >> 20} MiB of this model's tensors; the "
                   "samples ran one at a time (joining pays little on a model this large)")
    session = create_session(expose_tensors(model, tensors), providers=providers,
                             threads=threads, what="model (batch check)")
    outputs = {o.name for o in session.get_outputs()}
    names = [t for t in tensors if t in outputs]
    for feed, count in batches:
        differs = _first_difference(session, names, feed, count)
        if differs is not None:
            return 1, (f"batch-size: onnxruntime computes tensor {differs!r} differently for "
                       f"{count} samples joined than for one at a time; the samples ran one "
                       "at a time, so that the results do not depend on the batching")
    return batch_size, None


def exact_threads(
    model: onnx.ModelProto, source: DataSource, inputs: Sequence[InputSpec], threads: int,
    *, providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> tuple[int, str | None]:
    """`threads`, or 1 with the reason when onnxruntime computes the first sample of `source`
    differently at `threads` intra-op threads than at one. Every float tensor is compared while
    they fit in _CHECK_BYTES, else the model's outputs (a difference inside reaches them)."""
    if threads == 1:
        return 1, None
    first = next(iter(iter_batches(source, inputs, 1)), None)
    if first is None:
        return threads, None
    feed = first[0]
    tensors = _checked_tensors(model)
    if _estimated_bytes(model, tensors, feed) > _CHECK_BYTES:
        # the outputs, but not a ZipMap's sequence of dicts (dicts do not sort)
        tensors = [o.name for o in model.graph.output if o.type.HasField("tensor_type")]
    exposed = expose_tensors(model, tensors)
    outputs = {o.name for o in exposed.graph.output}
    names = [t for t in tensors if t in outputs]
    runs = []
    for count in (threads, 1):
        session = create_session(exposed, providers=providers, threads=count,
                                 what="model")
        try:
            runs.append(session.run(names, feed))
        except Exception:  # noqa: BLE001  the calibration pass names the sample that fails
            return threads, None
        del session
    for name, many, one in zip(names, *runs):
        if not _same_values(many, [one]):
            asked = "onnxruntime's default" if threads == 0 else str(threads)
            return 1, (f"threads: onnxruntime computes tensor {name!r} differently at {asked} "
                       "threads than at one; the statistics were collected at one thread, so "
                       "that the results do not depend on the thread count")
    return threads, None


def _checked_tensors(model: onnx.ModelProto) -> list[str]:
    """The main graph's float tensors that depend on the feed, in graph order (the first that
    differs is named, not one downstream of it). Shape arithmetic (a Cast of a Shape, scaled on
    its way to a Resize) counts the samples: it differs by design and is never observed."""
    types = element_types(model.graph)
    parameters = parameter_tensors(model.graph, UseIndex.build(model.graph),
                                   default_opset(model) or 1)
    fed = _fed_by_inputs(model.graph)  # the others are the same for any feed
    return list(dict.fromkeys(
        value for node in model.graph.node for value in node.output
        if types.get(value) in _FLOATS and value not in parameters and value in fed))


def _first_difference(session: Any, names: list[str], joined: Feed, n: int) -> str | None:
    """The first of `names` whose values differ between the `n` samples of `joined` run
    together and run one at a time (None: none)."""
    together = session.run(names, joined)
    # A tensor whose samples lie along dim 0 is compared sample by sample, one sample's run
    # alive at a time; any other (a sequence-first layout) whole, once every sample has run.
    kept: dict[int, list[np.ndarray]] = {}
    differs: set[int] = set()
    for i in range(n):
        alone = session.run(names, {k: v[i:i + 1] for k, v in joined.items()})
        if i == 0:
            kept = {p: [] for p, a in enumerate(alone)
                    if together[p].shape != (n, *a.shape[1:]) or a.shape[:1] != (1,)}
        for position, array in enumerate(alone):
            if position in kept:
                kept[position].append(array)
            elif not _same_values(together[position][i:i + 1], [array]):
                differs.add(position)
    differs |= {p for p, arrays in kept.items() if not _same_values(together[p], arrays)}
    return names[min(differs)] if differs else None


def _fed_by_inputs(graph: onnx.GraphProto) -> set[str]:
    """Values that depend on a graph input (through a node's inputs or the outer values its
    subgraphs read); the others are constants, folded or not."""
    fed = {v.name for v in graph.input} - {i.name for i in graph.initializer}
    for node in graph.node:  # topological order
        if any(v in fed for v in (*node.input, *subgraph_reads(node)) if v):
            fed.update(v for v in node.output if v)
    return fed


def _estimated_bytes(model: onnx.ModelProto, tensors: list[str], feed: Feed) -> int:
    """Bytes of `tensors` for `feed`, from the shapes shape inference left in the model with
    the feed's sizes for the symbolic dims of the inputs; a tensor of unknown size counts as
    the largest known one (the feed's own arrays at least)."""
    types = element_types(model.graph)
    known = {name: math.prod(shape) * _ITEM_BYTES.get(types.get(name, 0), 4)
             for name, shape in static_shapes(model.graph, feed).items()}
    largest = max([*known.values(), *(a.nbytes for a in feed.values())])
    return sum(known.get(t, largest) for t in tensors)


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

