"""Every error qcal reports to a user, each with its own exit code.

The CLI maps these to process exit codes; the README's exit-code table lists them all (a test
checks it). Raise the subclass that says what the user has to fix, with a message that names the
file, tensor or option at fault.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_USAGE",
    "AccuracyGateError",
    "CalibrationInterrupted",
    "ConfigError",
    "DataError",
    "DriftGateError",
    "EmptyStatisticsError",
    "ModelError",
    "OutputError",
    "QcalError",
    "StatisticsError",
    "one_line",
]

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug in qcal: please report it (the traceback is shown with --debug)
EXIT_USAGE = 2  # click's code for a malformed command line


class QcalError(Exception):
    """Base class of every error a user can act on."""

    exit_code: ClassVar[int] = EXIT_INTERNAL
    title: ClassVar[str] = "internal error"


class ConfigError(QcalError):
    """An option, preset parameter or config-file value is invalid or contradicts another."""

    exit_code = 3
    title = "bad configuration"


class ModelError(QcalError):
    """The model file is missing, unreadable, invalid, unsafe or cannot be quantized as asked."""

    exit_code = 4
    title = "bad model"


class DataError(QcalError):
    """Calibration or evaluation data is missing, unreadable or does not match the model."""

    exit_code = 5
    title = "bad data"


class EmptyStatisticsError(DataError):
    """An observer was asked for statistics before it saw any data."""


class OutputError(QcalError):
    """An output file cannot be written where asked (exists, same as input, bad directory)."""

    exit_code = 6
    title = "cannot write output"


class AccuracyGateError(QcalError):
    """A gate failed (accuracy, coverage, speed); the outputs and report are still written."""

    exit_code = 7
    title = "gate failed"


class DriftGateError(AccuracyGateError):
    """--fail-on-drift: a run moved further from its baseline report than the thresholds allow."""

    title = "drift gate failed"
class StatisticsError(QcalError):
    """A statistics or ranges file is unreadable, malformed, or does not fit the model, plan or
    method asked for (collect again, or choose options the file holds statistics for)."""

    exit_code = 8
    title = "statistics do not fit"


class CalibrationInterrupted(QcalError):
    """The user interrupted the run (SIGINT); no partial output is left behind."""

    exit_code = 130
    title = "interrupted"


def one_line(err: BaseException) -> str:
    """An exception's text on one line, as an error message carries it (onnx.checker and
    onnxruntime break theirs over several); its type's name when it has no text."""
    text = " ".join(str(err).split())
    return text or type(err).__name__
