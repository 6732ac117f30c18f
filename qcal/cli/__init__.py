"""The `qcal` command: a thin shell over the library that owns messages, progress and exit codes.

The consoles, the progress bar and the run's summary tables are in `qcal._cli_output`.
"""

from qcal.cli import (  # noqa: F401  (each registers its command)
    calibrate,
    collect,
    compare,
    diff,
    inspect,
    merge,
    presets,
    report,
)
from qcal.cli._app import main, reports_errors

__all__ = ["main", "reports_errors"]
