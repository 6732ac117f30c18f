"""Default exclusions: the graph patterns where quantizing a tensor costs much accuracy for no
compute, found before any data is seen. Used by the planner (`qcal.graph.plan`) unless
`SelectionRules.default_exclusions` is off (`--no-default-exclusions`).

1. Normalization statistics. A normalization divides (or multiplies) a tensor by a statistic
   computed from it: ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)``, RMSNorm's
   ``x * 1/sqrt(mean(x*x) + eps)``, softmax written out as ``e / sum(e)``. Quantizing the
   statistic (a variance spanning decades across rows, with one per-tensor step) or the tensor
   at the normalizing node (rows of small variance lose their few levels, and the division then
   magnifies the error by 1/std) breaks rows of small variance. Found as: a Reduce{Mean,Sum,
   SumSquare,L2} whose result flows only through elementwise ops (the statistic) into a Sub, Div
   or Mul that combines it with the tensor it was computed from (the normalizer). Kept float: the
   nodes computing the statistic, the nodes between that tensor and the Reduce (the squares), and
   the normalizer's inputs. The normalizer's output (the normalized values) is still quantized.
2. Softmax inputs. Attention logits span tens of units; one uint8 step of 0.2 there is a 20 %
   error in exp(). The tensor read by Softmax/LogSoftmax and, upstream, the tensors it is made of
   through reshapes, transposes and elementwise scaling or masking (up to the op producing the
   logits) stay float. The MatMul producing them still runs quantized: onnxruntime's integer
   MatMul has a float output.
3. Embedding lookups. A Gather from a constant float table with integer indices gains no speed
   from quantization, and one per-tensor scale for all rows (and for the looked-up vectors) wipes
   out rows of small norm. The Gather and its output stay float, but for an output only Conv,
   MatMul or Gemm nodes read: they read it quantized, as their integer kernels must (kept
   float, it kept a transliterator's decoder step's first Gemm, 19 % of its work, in float,
   and its coverage at 69.95 %; the floor's check still measures what the rounding costs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import onnx

from qcal.graph.structure import COMPUTE_OPS, DEFAULT_DOMAINS, FLOAT_TYPES, UseIndex

__all__ = ["TRAP_RULES_DOC", "Traps", "find_traps"]

TRAP_RULES_DOC = __doc__ or ""

_OFF = "default exclusion; --no-default-exclusions quantizes it"
_REDUCE_OPS = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2"})
_UNARY_OPS = frozenset({"Sqrt", "Reciprocal", "Neg", "Abs", "Exp", "Log", "Cast", "Identity"})
_BINARY_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Clip"})
_NORMALIZERS = frozenset({"Sub", "Div", "Mul"})
_SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
_LOGIT_PATH_OPS = frozenset(
    {"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast",
     "Mul", "Div", "Add", "Sub", "Where"}
)
_INTEGER_TYPES = frozenset({
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16, onnx.TensorProto.INT32, onnx.TensorProto.UINT32,
    onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
})
_MAX_DEPTH = 6  # path lengths searched upstream; real patterns need 1-3
# Readers of a looked-up vector that take it quantized whatever the lookup does: kept float,
# the vector would keep them float too (onnxruntime has no integer kernel for a float input;
# nor for a ConvTranspose at all).
_COMPUTE_OPS = COMPUTE_OPS - {"ConvTranspose"}


@dataclass
class Traps:
    """What the default exclusions keep float, each with its reason.

    Attributes:
        nodes: node name -> reason: the node is not quantized at all.
        reads: (node name, tensor) -> reason: that node reads that tensor in float.
        tensors: tensor -> reason: no node reads it quantized and its producer does not
            quantize it.
    """

    nodes: dict[str, str] = field(default_factory=dict)
    reads: dict[tuple[str, str], str] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)


def find_traps(
    graph: onnx.GraphProto,
    index: UseIndex,
    types: Mapping[str, int],
    constant: Callable[[str], onnx.TensorProto | None],
) -> Traps:
    """The default exclusions of one graph (module docstring), without looking at data.

    Args:
        graph: the graph (nodes in topological order).
        index: its use index.
        types: element types of its values.
        constant: the initializer holding a value, or None when it is not a constant.
    """
    finder = _Finder(index, types, constant)
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        if node.op_type in _REDUCE_OPS and node.input and node.output:
            finder.normalization(node)
        elif node.op_type in _SOFTMAX_OPS and node.input:
            finder.softmax(node)
        elif node.op_type == "Gather" and len(node.input) >= 2:
            finder.embedding(node)
    return finder.traps


class _Finder:
    def __init__(
        self,
        index: UseIndex,
        types: Mapping[str, int],
        constant: Callable[[str], onnx.TensorProto | None],
    ) -> None:
        self._index = index
        self._types = types
        self._constant = constant
        self.traps = Traps()

    # -- 1. normalization statistics ------------------------------------------------------

    def normalization(self, reduce: onnx.NodeProto) -> None:
        statistic_nodes, statistics = self._statistic_closure(reduce.output[0])
        normalizers = [
            (node, source)
            for node, source in self._combiners(statistics)
            if self._path_to(source, reduce.input[0]) is not None
        ]
        if not normalizers:
            return
        why = f"computes a normalization statistic ({reduce.op_type} {reduce.name!r}); {_OFF}"
        for node in statistic_nodes:
            self.traps.nodes.setdefault(node.name, why)
        for node, source in normalizers:
            for node_on_path in self._path_to(source, reduce.input[0]) or ():
                self.traps.nodes.setdefault(
                    node_on_path.name,
                    f"feeds the normalization statistic {reduce.name!r}; {_OFF}",
                )
            for tensor in node.input:
                if tensor and (tensor == source or tensor in statistics):
                    self.traps.reads.setdefault(
                        (node.name, tensor),
                        f"{tensor!r} read in float: {node.op_type} {node.name!r} normalizes by "
                        f"the statistic of {reduce.name!r}; {_OFF}",
                    )

    def _statistic_closure(self, start: str) -> tuple[list[onnx.NodeProto], set[str]]:
        """Elementwise nodes fed only by the statistic (and constants), and their outputs."""
        statistics, nodes, queue = {start}, [], [start]
        taken: set[str] = set()
        while queue:
            tensor = queue.pop()
            for reader in self._index.readers(tensor):
                if reader.name in taken or not self._is_elementwise(reader) or not reader.output:
                    continue
                others = [t for t in reader.input if t and t not in statistics]
                if all(self._constant(t) is not None for t in others):
                    taken.add(reader.name)
                    nodes.append(reader)
                    statistics.update(t for t in reader.output if t)
                    queue.extend(t for t in reader.output if t)
        return nodes, statistics

    def _combiners(self, statistics: set[str]) -> Iterable[tuple[onnx.NodeProto, str]]:
        """(node, other input) for Sub/Div/Mul nodes combining a statistic with a tensor."""
        seen: set[tuple[str, str]] = set()
        for tensor in sorted(statistics):
            for reader in self._index.readers(tensor):
                if reader.op_type not in _NORMALIZERS or reader.domain not in DEFAULT_DOMAINS:
                    continue
                for other in reader.input:
                    if (other and other not in statistics and self._constant(other) is None
                            and (reader.name, other) not in seen):
                        seen.add((reader.name, other))
                        yield reader, other

    def _path_to(self, source: str, target: str) -> list[onnx.NodeProto] | None:
        """Elementwise nodes leading from `source` to `target` ([] when equal), else None."""
        if source == target:
            return []
        frontier: list[tuple[str, list[onnx.NodeProto]]] = [(target, [])]
        for _ in range(_MAX_DEPTH):
            next_frontier = []
            for tensor, path in frontier:
                producer = self._index.producer.get(tensor)
                if producer is None or not self._is_elementwise(producer):
                    continue
                for value in producer.input:
                    if value == source:
                        return [producer, *path]
                    if value and self._constant(value) is None:
                        next_frontier.append((value, [producer, *path]))
            frontier = next_frontier
        return None

    def _is_elementwise(self, node: onnx.NodeProto) -> bool:
        return node.domain in DEFAULT_DOMAINS and node.op_type in (_UNARY_OPS | _BINARY_OPS)

    # -- 2. softmax inputs ----------------------------------------------------------------

    def softmax(self, softmax: onnx.NodeProto) -> None:
        why = (f"feeds {softmax.op_type} {softmax.name!r} (logits: one quantization step is a "
               f"large error after exp); {_OFF}")
        frontier, seen = [softmax.input[0]], set()
        for _ in range(_MAX_DEPTH):
            next_frontier = []
            for tensor in frontier:
                if tensor in seen or self._types.get(tensor) not in FLOAT_TYPES:
                    continue
                seen.add(tensor)
                self.traps.tensors.setdefault(tensor, why)
                producer = self._index.producer.get(tensor)
                if producer is None or producer.op_type not in _LOGIT_PATH_OPS:
                    continue  # reached what computes the logits (MatMul, ...): it stays quantized
                # Reshaping, scaling or masking the logits: nothing left to quantize there.
                self.traps.nodes.setdefault(producer.name, why)
                next_frontier += [t for t in producer.input
                                  if t and self._constant(t) is None]
            frontier = next_frontier

    # -- 3. embedding lookups -------------------------------------------------------------

    def embedding(self, gather: onnx.NodeProto) -> None:
        table = self._constant(gather.input[0])
        if table is None or table.data_type not in FLOAT_TYPES:
            return
        if self._types.get(gather.input[1]) not in _INTEGER_TYPES:
            return
        rows = table.dims[_axis(gather)] if table.dims else 0
        why = (f"embedding lookup in a constant table of {rows} rows: a per-tensor scale "
               f"erases rows of small norm, and a float Gather is as fast; {_OFF}")
        self.traps.nodes.setdefault(gather.name, why)
        for tensor in gather.output:
            readers = self._index.readers(tensor) if tensor else []
            if readers and all(r.op_type in _COMPUTE_OPS for r in readers):
                continue  # what their integer kernels read: quantized as their input
            if tensor:
                self.traps.tensors.setdefault(tensor, why)


def _axis(node: onnx.NodeProto) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "axis"), 0)
