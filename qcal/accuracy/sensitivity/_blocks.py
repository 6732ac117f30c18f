"""Harm of blocks of tensors, narrowed down by halving: what a tensor does to the outputs,
found in a few dozen runs instead of one per tensor.

The error-jump localisation (`qcal.accuracy.localise`) sees where error appears, not what it
does later: PP-OCRv4's recognizer has a 16-channel depthwise Conv right after its stem whose
weight codes leave 41 dB at its own output and 19 dB at the model's (the layers after it
amplify that error about 200 times), ranked 108th of 268 by its jump. Measuring each tensor
alone finds it, at one run per tensor and sample.

Here the planned tensors, in the order the graph reads them, are cut into a few contiguous
blocks; each block is quantized alone (the switch model of `_models`, one session, flags for
any set of tensors) and its output harm measured on a few samples. The most harmful block is
then halved and both halves measured, again and again, within a budget of measurements: harm
that sits in one or a few tensors is found in about log2(tensors) halvings, and harm spread
over a block leaves that block whole, priced as a whole. A block's harm is the noise ratio of
the worst output (over the logits of softmax outputs), as in `_measure`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import onnx

from qcal.accuracy.evaluate import COMPARE_THREADS
from qcal.accuracy.sensitivity._measure import _NEGLIGIBLE, _run
from qcal.accuracy.sensitivity._models import _Models, switch_flags
from qcal.calibration.runtime import Feed, create_session
from qcal.graph.model import QuantPlan
from qcal.graph.qdq import QuantizedWeight
from qcal.numerics.errors import DataError
from qcal.numerics.onnx_mapping import OnnxQParams

__all__ = ["BlockHarm", "measure_blocks"]


# Blocks the tensors are first cut into, and measurements (blocks quantized alone) in all.
FIRST_BLOCKS = 8
MEASUREMENTS = 96
_WORKERS = 2  # measurements at once, on the calibration's two cores


@dataclass(frozen=True)
class BlockHarm:
    """Tensors quantized together alone, and the worst output's noise ratio that gave."""

    tensors: tuple[str, ...]  # in the order the graph reads them
    roles: tuple[str, ...]  # "activation" or "weight", per tensor
    harm: float
    on_logits: bool = False  # measured over the logits of the model's softmax outputs


def measure_blocks(
    model: onnx.ModelProto,
    plan: QuantPlan,
    activations: Mapping[str, OnnxQParams],
    weights: Mapping[str, QuantizedWeight],
    feeds: Sequence[Feed],
    *,
    first_blocks: int = FIRST_BLOCKS,
    measurements: int = MEASUREMENTS,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> tuple[BlockHarm, ...]:
    """The planned tensors of `model`'s main graph as blocks, each with its harm alone, the
    most harmful narrowed down (module docstring); most harmful first.

    Args:
        model: the prepared float model the plan was made for.
        plan, activations, weights: as for `measure_sensitivity`.
        feeds: the samples every measurement runs on (held in memory: a few).
        first_blocks: contiguous blocks the tensors are first cut into.
        measurements: blocks measured in all, the first ones included.
        providers: onnxruntime's execution providers.

    Raises:
        DataError: no samples, or onnxruntime failed on one.
    """
    if not feeds:
        raise DataError("block sensitivity data has no samples")
    models = _Models.build(model, plan, activations, weights)
    order = _reading_order(model, models)
    outputs = models.outputs
    if not order or not outputs:
        return ()
    session = create_session(models.switch, providers=providers, threads=COMPARE_THREADS,
                             what="sensitivity model")
    units = len(models.units)
    none = switch_flags(units)
    references = [_run(session, outputs, {**feed, models.selector: none}) for feed in feeds]
    for feed, reference in zip(feeds, references):  # until one tells the padding value
        mask_measured, models = models.measured({**feed, models.selector: none}, session,
                                                reference)
        if mask_measured:
            break
    positions = [models.positions(feed) for feed in feeds]

    def harm(block: tuple[int, ...]) -> float:
        noise = models.empty_noise()
        flags = switch_flags(units, block)
        for feed, reference, valid in zip(feeds, references, positions):
            noise.add(reference, _run(session, outputs, {**feed, models.selector: flags}),
                      valid)
        return noise.harm()

    size = -(-len(order) // max(1, first_blocks))
    first = [tuple(order[i:i + size]) for i in range(0, len(order), size)]
    # Measurements are independent runs of one session on one thread each (the same figures
    # whichever finishes first): two run at once, the two halves of a block, on two cores.
    with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="qcal-blocks") as pool:
        # (-harm, first position, block): the most harmful first, ties in graph order
        heap = [(-h, block[0], block) for block, h in zip(first, pool.map(harm, first))]
        spent = len(heap)
        heapq.heapify(heap)
        done: list[tuple[float, int, tuple[int, ...]]] = []
        worst = -heap[0][0]
        while heap and spent + 2 <= measurements:
            entry = heapq.heappop(heap)
            block = entry[2]
            if len(block) == 1 or -entry[0] <= max(_NEGLIGIBLE, 0.01 * worst):
                done.append(entry)  # a single tensor, or harm not worth narrowing down
                continue
            halves = (block[:len(block) // 2], block[len(block) // 2:])
            for part, h in zip(halves, pool.map(harm, halves)):
                heapq.heappush(heap, (-h, part[0], part))
            spent += 2
    found = sorted(done + heap)
    return tuple(
        BlockHarm(tuple(models.units[k][0] for k in block),
                  tuple(models.units[k][1] for k in block), -negative, bool(models.logits))
        for negative, _, block in found
    )


def _reading_order(model: onnx.ModelProto, models: _Models) -> list[int]:
    """Unit indices in the order the graph first reads them quantized (ties by name): blocks of
    neighbours in it are layers of one stage of the network."""
    position = {node.name: i for i, node in enumerate(model.graph.node)}
    first = [min((position.get(c, len(position)) for c in consumers), default=len(position))
             for consumers in models.consumers]
    return sorted(range(len(models.units)), key=lambda k: (first[k], models.units[k][0]))
