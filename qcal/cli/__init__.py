"""The `qcal` command: a thin shell over the library that owns messages, progress and exit codes.

The consoles, the progress bar and the run's summary tables are in `qcal._cli_output`.
"""

# each module registers its command
from qcal.cli import calibrate, compare, diff, inspect, presets, report  # noqa: F401
from qcal.cli._app import main, reports_errors

__all__ = ["main", "reports_errors"]
