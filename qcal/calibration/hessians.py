"""The inputs' second moments (``H = sum x x^T``) of the layers whose weights GPTQ rounds, and
their sums (bias correction).

A second pass over the calibration data, once the activations' parameters are known. Each
layer's input is taken as the quantized model will see it: the integer codes of its
QuantizeLinear, less the zero point, so H is a matrix of integers. Per batch it is computed in
float64, where every partial sum of such products is an integer below 2^53 and therefore exact,
then added into int64: the result is the same whatever the batch size or the order of the data.

Conv inputs are unfolded into the patches each output sees (zero padding included: a padded
position is a code equal to the zero point); a group of a grouped Conv has its own H.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.calibration.collect import expose_tensors
from qcal.calibration.layer_sums import (
    FINE_LIMIT,
    FINE_STEPS,
    Retake,
    add_sum_outputs,
    in_graph,
    read_sums,
)
from qcal.calibration.runtime import Feed, create_session, run_feed
from qcal.numerics.onnx_mapping import ONNX_CODE_LIMITS, OnnxQParams

__all__ = ["HessianTarget", "LayerInputs", "collect_hessians", "hessian_target"]

# Patches unfolded at a time (values): bounds the temporary memory of a large feature map.
_CHUNK_VALUES = 2**22
# A Conv's H takes the patches of at most this many output positions of each sample (evenly
# spaced): H's cost per position is the layer's inputs squared, which on large feature maps
# would be many times the cost of the model itself, and a few thousand positions per sample
# already measure the inputs' correlations.
POSITIONS_PER_SAMPLE = 4096
# Hessians held at once; more targets than fit are collected in further passes over the data.
MEMORY_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class HessianTarget:
    """A layer whose input's second moments are collected.

    Attributes:
        node: the Conv/MatMul/Gemm node.
        tensor: its data input (a quantized activation).
        scale, zero_point, code_range: the input's QuantizeLinear parameters (per tensor).
        groups: Conv groups (1 for MatMul/Gemm).
        kernel, strides, pads, dilations: Conv geometry over the spatial axes (empty for
            MatMul/Gemm); pads as ONNX lists them (all begins, then all ends).
        transposed: a Gemm with transA: its input is (K, M), not (M, K).
        inputs_per_group: columns of H (channels per group x kernel size, or K).
        products: collect H itself; False: only the inputs' sums (bias correction alone).
    """

    node: str
    tensor: str
    scale: float
    zero_point: int
    code_range: tuple[int, int]
    groups: int
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]
    dilations: tuple[int, ...]
    transposed: bool
    inputs_per_group: int
    products: bool = True

    @property
    def nbytes(self) -> int:
        return self.groups * self.inputs_per_group ** (2 if self.products else 1) * 8


@dataclass(frozen=True)
class LayerInputs:
    """What the second pass measured of a layer's input, in centred integer codes.

    Attributes:
        hessian: H per group (int64, groups x inputs x inputs), None when not asked for.
        sums: per group the sum of each input column over every position (int64).
        count: the positions summed (every output position of every sample; H may see an
            evenly spaced subset of them, see POSITIONS_PER_SAMPLE).
        scale: the input's scale: a code step in real units (the mean of input j is
            ``scale * sums[g, j] / count``).
        real_sums: the same sums of the input before quantization, in steps of
            ``scale / FINE_STEPS`` (integers, so they too are exact in any order).
    """

    hessian: np.ndarray | None
    sums: np.ndarray
    count: int
    scale: float
    real_sums: np.ndarray

    def means(self) -> np.ndarray:
        """The mean of each input column per group as quantized, in real units (float64)."""
        means: np.ndarray = self.sums * (self.scale / max(self.count, 1))
        return means

    def real_means(self) -> np.ndarray:
        """The mean of each input column per group before quantization (float64, to within
        the fine step: see _fine_codes)."""
        means: np.ndarray = self.real_sums * (self.scale / FINE_STEPS / max(self.count, 1))
        return means


def hessian_target(
    node: onnx.NodeProto, weight_shape: Sequence[int], act: OnnxQParams, *, products: bool = True
) -> HessianTarget | None:
    """The target for `node` reading weights of `weight_shape` through an input quantized
    with `act` (H too, or only the sums without `products`); None for a layer the pass
    does not unfold (input quantized per channel, 3-d Conv, auto_pad SAME, a weight not 2-d)."""
    if np.asarray(act.scale).size != 1:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    quantized = (float(np.asarray(act.scale)), int(np.asarray(act.zero_point)),
                 ONNX_CODE_LIMITS[act.dtype])
    if node.op_type == "Conv":
        spatial = len(weight_shape) - 2
        if spatial not in (1, 2):
            return None
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            return None
        return HessianTarget(
            node.name, node.input[0], *quantized, groups=int(attrs.get("group", 1)),
            kernel=tuple(weight_shape[2:]), strides=tuple(attrs.get("strides", [1] * spatial)),
            pads=tuple(attrs.get("pads", [0] * 2 * spatial)),
            dilations=tuple(attrs.get("dilations", [1] * spatial)), transposed=False,
            inputs_per_group=int(np.prod(weight_shape[1:])), products=products,
        )
    if node.op_type in ("MatMul", "Gemm") and len(weight_shape) == 2:
        trans_b = node.op_type == "Gemm" and bool(attrs.get("transB", 0))
        return HessianTarget(
            node.name, node.input[0], *quantized, groups=1, kernel=(), strides=(), pads=(),
            dilations=(), transposed=node.op_type == "Gemm" and bool(attrs.get("transA", 0)),
            inputs_per_group=int(weight_shape[1] if trans_b else weight_shape[0]),
            products=products,
        )
    return None


def _centered_codes(x: np.ndarray, target: HessianTarget) -> np.ndarray:
    """QuantizeLinear's codes of `x` (float32 division, half to even), less the zero point."""
    lo, hi = target.code_range
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.divide(np.asarray(x, dtype=np.float32), np.float32(target.scale))
    # in place from here: one float32 temporary for the whole tensor
    np.rint(q, out=q)
    np.nan_to_num(q, copy=False, nan=0.0)
    q += np.float32(target.zero_point)
    np.clip(q, lo, hi, out=q)
    q -= np.float32(target.zero_point)
    codes: np.ndarray = q.astype(np.float64)
    return codes


def _fine_codes(x: np.ndarray, target: HessianTarget) -> np.ndarray:
    """`x` in integer steps of scale / FINE_STEPS (float64 holding integers; NaN as 0), by a
    float32 product as onnxruntime takes it (`layer_sums`)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        fine = np.multiply(np.asarray(x, np.float32), np.float32(FINE_STEPS / target.scale))
    np.rint(fine, out=fine)  # in place: one float32 temporary for the whole tensor
    np.nan_to_num(fine, copy=False, nan=0.0)
    np.clip(fine, np.float32(-FINE_LIMIT), np.float32(FINE_LIMIT), out=fine)
    wide: np.ndarray = fine.astype(np.float64)
    return wide


def _largest_code(target: HessianTarget) -> int:
    lo, hi = target.code_range
    return max(abs(lo - target.zero_point), abs(hi - target.zero_point), 1)


class _ExactSum:
    """H accumulated in float64 while every entry is certainly an integer below 2^53 (so every
    sum is exact), moved into int64 before it could leave that range."""

    def __init__(self, target: HessianTarget) -> None:
        shape = (target.groups, target.inputs_per_group, target.inputs_per_group)
        self.products = target.products
        if not self.products:
            shape = (0, 0, 0)
        self.total = np.zeros(shape, np.int64)
        self.running = np.zeros(shape, np.float64)
        self.sums = np.zeros((target.groups, target.inputs_per_group), np.int64)
        self.real_sums = np.zeros((target.groups, target.inputs_per_group), np.int64)
        self.count = 0
        self.scale = target.scale
        self.square = _largest_code(target) ** 2
        self.bound = 0  # largest |entry| `running` can hold: positions x largest product
        # Rows held before a product: a block of every group's rows stays near _CHUNK_VALUES
        # values (a depthwise Conv has hundreds of groups of a few inputs each).
        self.rows = max(1, min(_CHUNK_VALUES // max(target.groups * target.inputs_per_group, 1),
                               2**53 // self.square))
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0

    def add_sums(self, sums: np.ndarray, real_sums: np.ndarray, positions: int) -> None:
        """Column sums (groups, inputs) of `positions` more rows, codes and fine steps."""
        self.sums += sums.astype(np.int64)
        self.real_sums += real_sums
        self.count += positions

    def add(self, rows: np.ndarray) -> None:
        """H[g] += rows[g].T @ rows[g] for rows (groups, n, inputs) of integers; rows wait
        until a block's worth has come, so small batches make one product, not many."""
        if not self.products:
            return
        self.pending.append(rows)
        self.pending_rows += rows.shape[1]
        if self.pending_rows >= self.rows:
            self._multiply()

    def _multiply(self) -> None:
        if not self.pending:
            return
        rows = np.concatenate(self.pending, axis=1) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.pending_rows = [], 0
        for start in range(0, rows.shape[1], self.rows):
            block = rows[:, start : start + self.rows]
            if self.bound + block.shape[1] * self.square >= 2**53:
                self.flush()
            self.running += np.transpose(block, (0, 2, 1)) @ block
            self.bound += block.shape[1] * self.square

    def flush(self) -> None:
        self.total += self.running.astype(np.int64)
        self.running[...] = 0.0
        self.bound = 0

    def result(self) -> LayerInputs:
        self._multiply()
        self.flush()
        return LayerInputs(self.total if self.products else None, self.sums, self.count,
                           self.scale, self.real_sums)


def _positions(out: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Output positions whose patches enter H: all of them, or POSITIONS_PER_SAMPLE evenly
    spaced (in row-major order) when a sample has more. Chosen from the shape alone, so a
    sample contributes the same positions whatever batch it comes in."""
    total = int(np.prod(out))
    flat = np.arange(total) if total <= POSITIONS_PER_SAMPLE else (
        np.arange(POSITIONS_PER_SAMPLE) * total // POSITIONS_PER_SAMPLE)
    return np.unravel_index(flat, tuple(out))


def _padded(x: np.ndarray, target: HessianTarget) -> tuple[np.ndarray, list[int]]:
    """One sample (channels, *spatial) with the Conv's zero padding (a code equal to the zero
    point, 0 once centred), and the Conv's output size."""
    spatial = len(target.kernel)
    begins, ends = target.pads[:spatial], target.pads[spatial:]
    padded = np.pad(x, [(0, 0)] + [(b, e) for b, e in zip(begins, ends)]) if any(
        target.pads) else x
    out = [
        (padded.shape[1 + a] - target.dilations[a] * (target.kernel[a] - 1) - 1)
        // target.strides[a] + 1
        for a in range(spatial)
    ]
    return padded, out


def _tap_sums(padded: np.ndarray, out: Sequence[int], target: HessianTarget) -> np.ndarray:
    """The sum over every output position of each patch column, (groups, inputs_per_group),
    int64, with nothing unfolded: one spatial axis at a time, each kernel tap's strided slice
    of that axis summed (k_h x H x W_out + k_h x k_w x H_out per channel, not k_h x k_w x
    H_out x W_out). `padded` holds integers, whose float64 sums are exact below 2^53."""
    spatial = len(target.kernel)
    sums = padded if padded[0].size * FINE_LIMIT < 2**53 else padded.astype(np.int64)
    # sums: (channels, spatial axes not yet summed..., taps of the axes summed...)
    for a in reversed(range(spatial)):
        axis = 1 + a
        step, dilation = target.strides[a], target.dilations[a]
        span = (out[a] - 1) * step + 1
        per_tap = []
        for tap in range(target.kernel[a]):
            index: list[slice] = [slice(None)] * sums.ndim
            index[axis] = slice(tap * dilation, tap * dilation + span, step)
            per_tap.append(sums[tuple(index)].sum(axis=axis))
        sums = np.stack(per_tap, axis=axis)
    # (channels, taps in row-major order) -> (groups, channels per group x taps), the
    # weight's own order
    return np.asarray(sums).astype(np.int64).reshape(target.groups, -1)


def _patches(padded: np.ndarray, out: Sequence[int], target: HessianTarget
             ) -> Iterable[np.ndarray]:
    """Unfolded patches of one padded sample at the positions H takes, as
    (groups, n, inputs_per_group), a block of positions at a time."""
    spatial = len(target.kernel)
    channels = padded.shape[0] // target.groups
    taps = list(np.ndindex(*target.kernel))
    coords = _positions(out)
    step = max(1, _CHUNK_VALUES // max(1, padded.shape[0] * len(taps)))
    for first in range(0, len(coords[0]), step):
        chosen = [c[first : first + step] for c in coords]
        columns = [
            padded[(slice(None),) + tuple(chosen[a] * target.strides[a]
                                          + tap[a] * target.dilations[a] for a in range(spatial))]
            for tap in taps
        ]
        # (channels, taps, positions) -> (groups, positions, channels per group x taps)
        unfolded = np.stack(columns, axis=1).reshape(target.groups, channels * len(taps), -1)
        yield np.transpose(unfolded, (0, 2, 1))


def _update(acc: _ExactSum, value: np.ndarray, target: HessianTarget) -> None:
    codes = _centered_codes(value, target)
    fine = _fine_codes(value, target)
    if target.kernel and not target.products and len(codes):
        # Sums alone are linear: the batch's samples summed first (integers, exact in int64),
        # then one sample's tap sums
        padded, out = _padded(codes.astype(np.int64).sum(axis=0), target)
        if min(out, default=1) > 0:
            fine_sum = _padded(fine.astype(np.int64).sum(axis=0), target)[0]
            acc.add_sums(_tap_sums(padded, out, target), _tap_sums(fine_sum, out, target),
                         len(codes) * int(np.prod(out)))
        return
    if not target.kernel:  # MatMul/Gemm: rows of the last axis (Gemm transA: columns)
        rows = codes.T if target.transposed else codes.reshape(-1, codes.shape[-1])
        real = fine.T if target.transposed else fine.reshape(-1, fine.shape[-1])
        acc.add_sums(rows.astype(np.int64).sum(axis=0)[None],
                     real.astype(np.int64).sum(axis=0)[None], rows.shape[0])
        acc.add(rows[None])
        return
    for sample, fine_sample in zip(codes, fine):
        padded, out = _padded(sample, target)
        if min(out, default=1) <= 0:
            continue
        acc.add_sums(_tap_sums(padded, out, target),
                     _tap_sums(_padded(fine_sample, target)[0], out, target), int(np.prod(out)))
        if target.products:
            for block in _patches(padded, out, target):
                acc.add(block)


def collect_hessians(
    model: onnx.ModelProto,
    targets: Sequence[HessianTarget],
    batches: Callable[[], Iterable[tuple[Feed, int]]],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, LayerInputs]:
    """What each target node's input holds over every batch `batches()` gives: H (int64,
    groups x inputs x inputs) where the target asks for it, and the inputs' sums.

    Targets whose Hessians do not fit in MEMORY_BUDGET_BYTES together are collected in further
    passes; a target alone above the budget is left out (its weights round to nearest).
    """
    passes: list[list[HessianTarget]] = []
    held = math.inf
    for target in sorted(targets, key=lambda t: t.node):
        if target.nbytes > MEMORY_BUDGET_BYTES:
            continue
        if held + target.nbytes > MEMORY_BUDGET_BYTES:
            passes.append([])
            held = 0
        passes[-1].append(target)
        held += target.nbytes
    hessians: dict[str, LayerInputs] = {}
    for group in passes:
        # Sums alone are taken inside onnxruntime where it can; H needs the whole input here.
        summed = in_graph(model, [t for t in group if not t.products])
        in_onnxruntime = {t.node for t in summed}
        tensors = sorted({t.tensor for t in group if t.node not in in_onnxruntime})
        counted, sum_outputs = add_sum_outputs(model, summed)
        names = tensors + sorted({name for o in sum_outputs.values()
                                  for name in (o.codes, o.fine, o.shape, o.total)})
        session = create_session(expose_tensors(counted, tensors), providers=providers,
                                 threads=threads, what="layer-input model", node_order=True,
                                 literal_qdq=True)
        del counted
        retake = Retake(model, summed, providers, threads)
        acc = {t.node: _ExactSum(t) for t in group}
        for feed, n in batches():
            values = run_feed(session, names, feed,
                              what="layer-input pass (GPTQ, bias correction)")
            for target in group:
                if target.node not in in_onnxruntime:
                    _update(acc[target.node], values[target.tensor], target)
                    continue
                sums = read_sums(target, sum_outputs[target.node], values)
                if sums is None:  # not exact in onnxruntime for this batch: numpy's way
                    _update(acc[target.node], retake.tensor(target.tensor, feed), target)
                elif sums[2] > 0:
                    acc[target.node].add_sums(*sums)
            retake.forget()
            if on_batch is not None:
                on_batch(n)
        hessians.update({node: sums.result() for node, sums in acc.items()})
    return hessians
