"""`collect --ray`: the calibration data in shards across Ray workers, their statistics merged.

Each worker runs the shard's samples through its own onnxruntime session (one intra-op thread
unless --threads says otherwise) and its own observers, and returns the statistics file's bytes;
the driver merges them (exact: the result is byte-identical to one process over all the data).
Shards are contiguous runs of samples, a few per worker so that progress moves and a retried
shard costs little. A shard whose worker dies is run again by Ray; an error in the data or the
model stops the run. Ctrl-C cancels every shard and writes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path
from typing import Any

from qcal._collection import collect_statistics, prepare_collection, range_method
from qcal._stages import Progress
from qcal.calibration.statistics import Statistics, merge_statistics
from qcal.config import CalibrationConfig
from qcal.graph.files.atomic import check_output_path, write_atomic
from qcal.numerics.errors import ConfigError, DataError, QcalError
from qcal.numerics.observers import PerTensor
from qcal.numerics.presets import build_preset

__all__ = ["collect_on_ray"]

SHARDS_PER_WORKER = 2
_RETRIES = 2
# Signals a job is stopped by that Ray's core would take over (`collect_on_ray`).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# For the tests of retries: the first shard to find no file at this path creates it and kills
# its worker process, as a machine lost mid-shard would.
_CRASH_ONCE = "QCAL_RAY_CRASH_ONCE"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'qcal[ray]'") from None
    return ray


def _collect_shard(model_path: Path, config: CalibrationConfig, histograms: bool,
                   start: int, stop: int) -> bytes:
    marker = os.environ.get(_CRASH_ONCE)
    if marker:
        try:
            with open(marker, "x"):
                pass
        except FileExistsError:
            pass
        else:
            os._exit(1)
    stats = collect_statistics(model_path, config, histograms=histograms, shard=(start, stop))
    return stats.to_bytes()


def shard_bounds(samples: int, shards: int) -> list[tuple[int, int]]:
    """`shards` contiguous runs covering [0, samples), sizes differing by at most one."""
    shards = max(1, min(shards, samples))
    base, extra = divmod(samples, shards)
    bounds, start = [], 0
    for k in range(shards):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def collect_on_ray(
    model_path: Path,
    config: CalibrationConfig,
    *,
    output: Path | None,
    force: bool = False,
    histograms: bool = True,
    address: str = "local",
    workers: int | None = None,
    progress: Progress | None = None,
) -> Statistics:
    """Collect the statistics of `model_path` on Ray and write them to `output`.

    `address` "local" starts a Ray for this run (stopped after it); otherwise it is given to
    ``ray.init`` (``auto``, ``ray://host:10001``): the model and data must be readable at the
    same paths on every node.
    """
    ray = _import_ray()
    if workers is not None and workers < 1:
        raise ConfigError(f"workers: {workers} must be at least 1")
    recipe = build_preset(config.preset, config.preset_options).activation
    ordered = sorted({config.method, *(o.method for o in config.tensors.values() if o.method)})
    for method in ordered:
        if recipe.observer(range_method(method), PerTensor()).is_order_dependent:
            raise ConfigError(f"--ray: {method} statistics depend on the order of the batches "
                              "and cannot be collected in shards; collect them in one process")
    run = prepare_collection(model_path, config)  # every check before Ray starts
    samples = run.source.num_samples()
    if run.weight_file is not None:
        run.weight_file.close()
    if not samples:
        raise DataError("calibration data has no samples" if samples == 0 else
                        "--ray needs data whose sample count is known")
    read = [model_path, *run.loaded.external_files, *([run.source.path] if run.source.path else [])]
    if output is not None:
        check_output_path(output, inputs=read, force=force, what="output")
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
        if address == "local":
            kwargs["num_cpus"] = workers
        else:
            kwargs["address"] = address
        # Ray's core takes SIGTERM for itself (it logs a stack and exits 1, mid-write): the
        # handlers the caller had (the command line's stop cleanly, exit 143) are put back.
        handlers = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
        try:
            ray.init(**kwargs)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise ConfigError(f"--ray {address}: cannot reach the Ray cluster ({err})") from None
        finally:
            if threading.current_thread() is threading.main_thread():
                for signum, handler in handlers.items():
                    if handler is not None:
                        signal.signal(signum, handler)
    try:
        count = workers or max(1, int(ray.available_resources().get("CPU", 1)))
        if config.threads == 0:  # one onnxruntime thread per worker: the workers share the cores
            config = dataclasses.replace(config, threads=1)
        task = ray.remote(num_cpus=1, max_retries=_RETRIES)(_collect_shard)
        pending = {
            task.remote(model_path.resolve(), config, histograms, start, stop): (start, stop)
            for start, stop in shard_bounds(samples, count * SHARDS_PER_WORKER)
        }
        if progress is not None:
            progress("collect", 0, samples)
        results: dict[int, bytes] = {}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    start, stop = pending.pop(ref)
                    results[start] = _shard_result(ray, ref, start, stop)
                    if progress is not None:
                        progress("collect", stop - start, samples)
        except BaseException:
            # A Ray this run started is shut down below, which ends its workers. Force-cancelling
            # a task that is finishing at that moment can abort the whole process inside Ray
            # (its task manager's "unexpected system state"), so only a cluster that outlives
            # the run has its tasks cancelled.
            if not started:
                for ref in pending:
                    ray.cancel(ref, force=True)
            raise
    finally:
        if started:
            ray.shutdown()
    parts = [(f"shard {start}", Statistics.from_bytes(results[start], f"shard {start}"))
             for start in sorted(results)]
    merged = merge_statistics(parts)
    if output is not None:
        write_atomic(output, merged.to_bytes())
    return merged


def _shard_result(ray: Any, ref: Any, start: int, stop: int) -> bytes:
    try:
        return ray.get(ref)  # type: ignore[no-any-return]
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, QcalError):  # a fault in the data or the model: as in one process
            raise cause from None
        raise
    except ray.exceptions.WorkerCrashedError:
        raise DataError(f"samples {start}-{stop - 1}: the Ray worker died {_RETRIES + 1} times "
                        "on this shard") from None
