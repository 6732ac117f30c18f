"""qcal: post-training calibration of ONNX models into QDQ models."""

import logging

from qcal._version import __version__

from qcal.config import CalibrationConfig, TensorOverride
from qcal.numerics.errors import (
    AccuracyGateError,
    CalibrationInterrupted,
    ConfigError,
    DataError,
    EmptyStatisticsError,
    ModelError,
    OutputError,
    QcalError,
    StatisticsError,
)
from qcal.accuracy.evaluate import Comparison, OutputMetrics, compare_models
from qcal.numerics.fakequant import fake_quantize, quantize
from qcal.numerics.histogram import (
    Histogram,
    HistogramObserver,
    RangeSelection,
    entropy_range,
    mse_range,
    percentile_range,
    select_range,
)
from qcal.numerics.observers import (
    DataPolicy,
    FixedRangeObserver,
    Granularity,
    MindSporeObserver,
    MinMaxObserver,
    MinMaxStats,
    MovingAverageMinMaxObserver,
    Observer,
    OneFlowMovingAverageObserver,
    PerChannel,
    PerTensor,
)
from qcal.numerics.observer_state import observer_from_dict
from qcal.numerics.onnx_mapping import OnnxQParams, to_onnx_qparams
from qcal.numerics.presets import PRESETS, Preset, PresetSpec, TensorRecipe, build_preset
from qcal.pipeline import CalibrationResult, calibrate
from qcal._collection import collect_statistics
from qcal.calibration.statistics import Statistics, merge_statistics, read_statistics
from qcal.numerics.schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    QParams,
    Rounding,
    Scheme,
    TFScheme,
    TorchScheme,
    compute_qparams,
)

__all__ = [
    # the calibration run, its configuration and its errors
    "AccuracyGateError",
    "CalibrationConfig",
    "CalibrationInterrupted",
    "CalibrationResult",
    "Comparison",
    "ConfigError",
    "DataError",
    "EmptyStatisticsError",
    "ModelError",
    "OutputError",
    "OutputMetrics",
    "QcalError",
    "TensorOverride",
    "calibrate",
    "compare_models",
    # statistics files: collect, read, merge (calibrate(..., statistics=path) uses one)
    "Statistics",
    "StatisticsError",
    "collect_statistics",
    "merge_statistics",
    "read_statistics",
    # statistics, parameters, fake-quant, presets and the ONNX mapping
    "PRESETS",
    "DataPolicy",
    "FixedRangeObserver",
    "Granularity",
    "Histogram",
    "HistogramObserver",
    "HorizonScheme",
    "LearnedScaleScheme",
    "MinMaxObserver",
    "MinMaxStats",
    "MindSporeObserver",
    "MindSporeScheme",
    "MovingAverageMinMaxObserver",
    "Observer",
    "OneFlowMovingAverageObserver",
    "OneFlowScheme",
    "OnnxQParams",
    "PerChannel",
    "PerTensor",
    "Preset",
    "PresetSpec",
    "QParams",
    "RangeSelection",
    "Rounding",
    "Scheme",
    "TFScheme",
    "TensorRecipe",
    "TorchScheme",
    "__version__",
    "build_preset",
    "compute_qparams",
    "entropy_range",
    "fake_quantize",
    "mse_range",
    "observer_from_dict",
    "percentile_range",
    "quantize",
    "select_range",
    "to_onnx_qparams",
]

# The library never prints: its log records go where the application sends them (the CLI shows
# what matters in its summary), never to Python's last-resort handler on stderr.
logging.getLogger(__name__).addHandler(logging.NullHandler())
