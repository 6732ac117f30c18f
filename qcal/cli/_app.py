"""The `qcal` group, how library errors become messages and exit codes, and signals."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.markup import escape

import qcal
from qcal._cli_output import stderr
from qcal.numerics.errors import EXIT_INTERNAL, CalibrationInterrupted, QcalError

F = TypeVar("F", bound=Callable[..., Any])

# Flags that shape the run but are not part of CalibrationConfig; the config file may set them too.
_OUTPUT_KEYS = ("output", "report", "force")


def reports_errors(command: F) -> F:
    """Turn library errors into one-line messages and documented exit codes."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug"))
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as stop:
            # a library may raise its own interrupt where ours came in (Ray's wait does)
            signum = getattr(stop, "signum", _received[-1] if _received else signal.SIGINT)
            err = CalibrationInterrupted(
                f"interrupted by {signal.Signals(signum).name}; no output was written")
            stderr.print(f"[bold red]error:[/] {err}")
            # The way out has removed every temporary file. Leave without the interpreter's
            # exit, which joins worker threads: an interrupt raised while the main thread held
            # a lock a worker waits on would make that join wait forever.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + int(signum))
        except QcalError as err:
            if debug:  # the traceback, and still the error's own exit code: a CI job's step
                traceback.print_exc()  # run with --debug must not read a bad input as a bug
            # Escaped: a message may hold brackets (a tensor name, `pip install 'qcal[ray]'`).
            stderr.print(f"[bold red]error ({err.title}):[/] {escape(str(err))}", soft_wrap=True)
            raise SystemExit(err.exit_code) from None
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as err:  # a bug: say so plainly, keep the traceback for --debug
            if debug:
                raise
            stderr.print(
                f"[bold red]internal error:[/] {type(err).__name__}: {escape(str(err))} "
                "(rerun with --debug for the traceback)", soft_wrap=True,
            )
            raise SystemExit(EXIT_INTERNAL) from None

    return run  # type: ignore[return-value]


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (how CI systems and closing terminals stop a job), raised where the
    program is, like Ctrl-C: temporary files are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # the stop signals that came, in order


def _raise_stopped(signum: int, frame: object) -> None:
    _received.append(signum)
    raise _Stopped(signum)


def _sigint_as_keyboard_interrupt() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_stopped)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(qcal.__version__, prog_name="qcal")
def main() -> None:
    """Calibrate float ONNX models into QDQ models with framework-exact quantization semantics."""
    _sigint_as_keyboard_interrupt()


_path = click.Path(path_type=Path)
_existing = click.Path(exists=False, path_type=Path)
