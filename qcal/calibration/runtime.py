"""onnxruntime sessions for calibration and evaluation, built the same way everywhere."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from qcal.graph.files.large import (
    external_file,
    is_external,
    serialize_within,
    serialized_size,
)
from qcal.graph.files.save import stage_model
from qcal.graph.random_draws import kernel_probes, with_fixed_draws
from qcal.numerics.errors import ConfigError, DataError, ModelError

__all__ = ["Feed", "available_providers", "create_session", "run_batches", "run_feed", "share_one_pool"]

# One run's inputs: input name -> array (a sample, or samples joined into a batch).
Feed = Mapping[str, np.ndarray]

# Protobuf cannot serialise a message of 2 GiB or more; such models go through a temp folder.
_MAX_INLINE_BYTES = 2**31 - 2**24


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


# The thread count of this process's one onnxruntime pool, once `share_one_pool` made it.
_SHARED_POOL: list[int] = []


def share_one_pool(threads: int) -> None:
    """Give this process one pool of `threads` onnxruntime threads, which every session it
    opens then runs on (onnxruntime allows no other once a process has one), before it opens
    any. The pool's idle threads spin, as a session's own pool's do by default."""
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_global_thread_pool_sizes(threads, 1)
    _SHARED_POOL.append(threads)


def _session_options(
    threads: int, *, node_order: bool = False, optimize: bool = True, spin: bool = False,
    literal_qdq: bool = False,
) -> ort.SessionOptions:
    options = ort.SessionOptions()
    if _SHARED_POOL:  # `share_one_pool`: the process's pool, its threads and spinning
        options.use_per_session_threads = False
    if literal_qdq:
        # Q/DQ nodes that compute codes, not a model to deploy: onnxruntime's QDQ rewrites
        # (moving a DequantizeLinear past a Reshape, ...) are of no use there, and at opset 21
        # they write a QuantizeLinear whose types do not match (int8 codes, uint8 zero point).
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if not spin and not _SHARED_POOL:
        # Idle onnxruntime threads sleep instead of spinning: a core they would spin on is
        # free for qcal's work between runs (statistics, metrics, the next batch's data) and
        # for onnxruntime's other sessions, and on a busy machine for other processes.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if node_order:
        # Nodes run in the order the model lists them (where dependencies allow): a node
        # placed right after a producer runs while its input is still in cache.
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # Fatal only: onnxruntime's errors reach the caller as exceptions (reported by qcal in one
    # line); printed as well, they would put its multi-line log on the user's terminal.
    options.log_severity_level = 4
    if threads and not _SHARED_POOL:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


def create_session(
    model: onnx.ModelProto,
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 0,
    what: str = "model",
    node_order: bool = False,
    optimize: bool = True,
    spin: bool = False,
    repack: bool = False,
    optimized_to: Path | None = None,
    literal_qdq: bool = False,
) -> ort.InferenceSession:
    """Open `model` in onnxruntime; `what` names the model in error messages.

    With `node_order`, nodes run in the order the model lists them where dependencies allow
    (onnxruntime's default order may run them much later). Without `optimize`, onnxruntime
    skips its graph optimizations: the session opens faster and runs slower, which pays for a
    session that runs once. Its idle threads sleep rather than spin, leaving their cores to
    qcal's work between runs and to its other open sessions (an evaluation alternates two: the
    idle one's spinning threads took the cores from the running one, and on a loaded machine
    doubled the evaluation's time); with `spin`, they spin as in onnxruntime's default, for
    timings of what a deployment sees and for runs with little work between them.

    Initializers kept in files (see `qcal.graph.files.large`) are mapped by onnxruntime from their
    files, not copied, and not repacked either: the session holds no second copy of them. With
    `repack`, onnxruntime repacks them as it does for any deployed model (a copy of each weight
    in its kernels' layout), for timings: its integer kernels run much slower on unpacked weights.
    With `optimized_to`, onnxruntime also writes the graph it will run there (after its fusions).
    With `literal_qdq`, onnxruntime runs QuantizeLinear/DequantizeLinear nodes as they are
    written, without its QDQ fusions (for graphs that compute integer codes). In a process
    that has one pool (`share_one_pool`), the session runs on it: `threads` and `spin` are the
    pool's.

    A model that draws random values runs with fixed draws of them instead, the same on every
    run (`qcal.graph.random_draws`).
    """
    missing = [p for p in providers if p not in ort.get_available_providers()]
    if missing:
        raise ConfigError(
            f"provider: {', '.join(missing)} not available in this onnxruntime "
            f"(available: {', '.join(ort.get_available_providers())})"
        )
    fixed = with_fixed_draws(model)
    if fixed is not None:
        _check_random_kernels(model, providers, what)
        model = fixed
    options = _session_options(threads, node_order=node_order, optimize=optimize, spin=spin,
                               literal_qdq=literal_qdq)
    if optimized_to is not None:
        options.optimized_model_filepath = str(optimized_to)
        # Large weights go to a file beside it: the graph is what is read back.
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", f"{optimized_to.name}.data")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(1 << 20))
    try:
        model_bytes = _mapping_weights(model, options, what, repack=repack)
        if model_bytes is not None:
            return ort.InferenceSession(model_bytes, sess_options=options, providers=list(providers))
        with tempfile.TemporaryDirectory(prefix="qcal-") as tmp:
            # Not onnx.save_model: it moves the weights out of `model`, which callers still use.
            path = Path(tmp) / "model.onnx"
            with stage_model(model, path, external=True) as staged:
                staged.commit()
            return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except _LOAD_ERRORS as err:
        raise _cannot_load(what, err) from None


# The kinds of random node onnxruntime was found to load (`kernel_probes`), with its providers.
_LOADED_PROBES: set[tuple[bytes, tuple[str, ...]]] = set()


def _check_random_kernels(model: onnx.ModelProto, providers: Sequence[str], what: str) -> None:
    """Raise ModelError, as for the model itself, when onnxruntime cannot load one of `model`'s
    random nodes: the model's copy with fixed draws (`create_session`) has none of them to
    fail on, and the model qcal writes keeps them."""
    for key in kernel_probes(model):
        if (key, tuple(providers)) in _LOADED_PROBES:
            continue
        options = _session_options(1, optimize=False)
        try:
            ort.InferenceSession(key, sess_options=options, providers=list(providers))
        except _LOAD_ERRORS as err:
            raise _cannot_load(what, err) from None
        _LOADED_PROBES.add((key, tuple(providers)))


# What onnxruntime raises for a model it cannot load.
_LOAD_ERRORS = (ort.capi.onnxruntime_pybind11_state.Fail,
                ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                ort.capi.onnxruntime_pybind11_state.NotImplemented)


def _cannot_load(what: str, err: Exception) -> ModelError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ModelError(f"{what}: onnxruntime cannot load it: {first_line}")


def _mapping_weights(
    model: onnx.ModelProto, options: ort.SessionOptions, what: str, *, repack: bool
) -> bytes | None:
    """The bytes onnxruntime gets for `model`, with `options` set to map its initializers kept
    in files (absolute locations, which onnxruntime refuses: it gets them relative to the root
    of the file system they are on); None when the model is too large to pass inline."""
    model_bytes: bytes
    if not any(is_external(t) for t in model.graph.initializer):
        return serialize_within(model, _MAX_INLINE_BYTES - 1)
    if serialized_size(model) >= _MAX_INLINE_BYTES:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # small: the large tensors are in files
    roots = set()
    for tensor in copy.graph.initializer:
        if is_external(tensor):
            path = external_file(tensor)[0]
            roots.add(path.anchor)
            location = next(e for e in tensor.external_data if e.key == "location")
            location.value = path.relative_to(path.anchor).as_posix()
    if len(roots) > 1:
        raise ModelError(f"{what}: its weights are on several drives ({', '.join(sorted(roots))})")
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", roots.pop()
    )
    if not repack:  # prepacking keeps a repacked copy of every weight besides the mapped file
        options.add_session_config_entry("session.disable_prepacking", "1")
    model_bytes = copy.SerializeToString()
    return model_bytes


def run_batches(
    session: ort.InferenceSession, names: Sequence[str],
    batches: Iterable[tuple[Feed, int]], *, what: str,
    on_batch: Callable[[int], None] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """The outputs `names` of `session` for each of `batches`, by name; a DataError naming the
    pass (`what`) when onnxruntime fails; `on_batch(n)` once the caller has used a batch."""
    for feed, n in batches:
        yield run_feed(session, names, feed, what=what)
        if on_batch is not None:
            on_batch(n)


def run_feed(
    session: ort.InferenceSession, names: Sequence[str], feed: Feed, *,
    what: str,
) -> dict[str, np.ndarray]:
    """The outputs `names` of `session` for one feed, by name (errors as `run_batches`)."""
    try:
        values = session.run(list(names), dict(feed))
    except Exception as err:  # noqa: BLE001  onnxruntime raises untyped exceptions
        raise DataError(f"onnxruntime failed on the {what}: {err}") from None
    return dict(zip(names, values))
