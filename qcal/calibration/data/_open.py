"""The entry point `open_data`: picks the reader for a path (by file suffix or folder contents),
finds data beside the model when no path is given, or makes synthetic data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qcal.calibration.data._npy import ARRAY_SUFFIXES
from qcal.calibration.data._npz_dir import NpzDirSource, _npz_files
from qcal.calibration.data._npz_file import NpzSource
from qcal.calibration.data._onnx_test_data import (
    OnnxTestDataSource,
    _input_pb_files,
    _test_data_sets,
)
from qcal.calibration.data._source import DataSource
from qcal.calibration.data._synthetic import SyntheticSource
from qcal.numerics.errors import ConfigError, DataError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec

logger = logging.getLogger(__name__)


def _open_path(path: Path, inputs: Sequence[InputSpec], limit: int | None) -> DataSource:
    if not path.exists():
        raise DataError(f"{path}: calibration data not found")
    if not path.is_dir():
        if path.suffix.lower() in ARRAY_SUFFIXES:
            return NpzSource(path, inputs, limit=limit)
        raise DataError(
            f"{path}: unsupported data file; expected an .npz file (a .npy file for a model with"
            " one input), a folder of such files or test_data_set_* folder(s)"
        )
    if _input_pb_files(path):
        return OnnxTestDataSource(path, [path], inputs, limit=limit)
    sets, npzs = _test_data_sets(path), _npz_files(path)
    if sets and npzs:
        raise DataError(
            f"{path}: holds both .npz/.npy files and test_data_set_* folders; point --data at one"
            " kind"
        )
    if sets:
        return OnnxTestDataSource(path, sets, inputs, limit=limit)
    if npzs:
        return NpzDirSource(path, inputs, limit=limit)
    raise DataError(
        f"{path}: no calibration data in this folder; expected .npz (or .npy) files, input_J.pb"
        " files or test_data_set_* folders"
    )


def _discover(model_path: Path, inputs: Sequence[InputSpec], limit: int | None) -> DataSource:
    """Data beside the model: <stem>.calib.npz (names this model, so it wins), test_data_set_*."""
    folder = model_path.parent
    calib = folder / f"{model_path.stem}.calib.npz"
    if calib.is_file():
        logger.info("using calibration data found beside the model: %s", calib)
        return NpzSource(calib, inputs, limit=limit)
    sets = _test_data_sets(folder)
    if sets:
        logger.info(
            "using %d test_data_set folder(s) found beside the model in %s", len(sets), folder
        )
        return OnnxTestDataSource(folder, sets, inputs, limit=limit)
    raise DataError(
        f"{model_path}: no calibration data given and none found beside the model (looked for"
        f" {calib.name} and test_data_set_* folders); pass --data PATH (an .npz file, a folder of"
        " .npz files or test_data_set_* folders) or --synthetic N for random, uncalibrated data"
    )


def open_data(
    path: Path | None,
    *,
    model_path: Path,
    inputs: Sequence[InputSpec],
    synthetic: int | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> DataSource:
    """Open the calibration data at `path`, or find it beside the model, or make it up.

    Args:
        path: an .npz file (a .npy file for a model with one input), a folder of such files
            (one sample each), a test_data_set_K folder or a folder of them;
            None looks beside `model_path` for ``<stem>.calib.npz``, then ``test_data_set_*``.
        model_path: the model the data is for (where discovery looks).
        inputs: the model's inputs (decide how .npz arrays are split and how .pb files map).
        synthetic: make this many random samples instead (`SyntheticSource`); excludes `path`.
        limit: use at most this many samples.
        seed: seed of the synthetic data.

    Raises:
        ConfigError: limit or synthetic below 1, or synthetic together with path.
        DataError: data missing, unreadable, or holding no samples.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be a positive number of samples, got {limit}")
    if synthetic is not None:
        if path is not None:
            raise ConfigError(f"--synthetic {synthetic} and --data {path} exclude each other")
        if synthetic < 1:
            raise ConfigError(f"--synthetic must be a positive number of samples, got {synthetic}")
        count = synthetic if limit is None else min(synthetic, limit)
        return SyntheticSource(inputs, count=count, seed=seed)
    source = (
        _open_path(path, inputs, limit)
        if path is not None
        else _discover(model_path, inputs, limit)
    )
    if source.num_samples() == 0:
        raise DataError(f"{source.path}: holds no samples")
    return source
