"""Output files: checked before any work starts, written whole or not at all."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from qcal.numerics.errors import OutputError

__all__ = ["StagedFile", "check_output_path", "sha256_of_file", "stage_file", "write_atomic"]


def check_output_path(path: Path, *, inputs: Iterable[Path], force: bool, what: str) -> None:
    """Refuse an output that would overwrite an input, an existing file (without force), or that
    sits in a missing or read-only directory. `what` names the option ("output", "report")."""
    resolved = path.resolve()
    for source in inputs:
        if source.exists() and resolved == source.resolve():
            raise OutputError(f"{what} {path}: is the same file as the input {source}")
    if resolved.is_dir():
        raise OutputError(f"{what} {path}: is a directory")
    parent = resolved.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{what} {path}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: directory {parent} is not writable")
    try:  # before any work: the access bits do not tell (root, read-only or virtual mounts)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OutputError(f"{what} {path}: cannot write in directory {parent} "
                          f"({err.strerror or err})") from None
    if resolved.exists() and not force:
        raise OutputError(f"{what} {path}: already exists (use --force to overwrite)")


class StagedFile:
    """Bytes written whole to a temporary file beside `path`, until `commit` renames it there
    or `discard` (also on leaving a ``with`` block) removes it."""

    def __init__(self, path: Path, staged: Path) -> None:
        self.path = path
        self._staged: Path | None = staged

    def commit(self) -> None:
        if self._staged is None:
            return
        try:
            os.replace(self._staged, self.path)
        except OSError as err:
            self.discard()
            raise OutputError(f"cannot write {self.path}: {err.strerror or err}") from None
        self._staged = None

    def discard(self) -> None:
        if self._staged is not None:
            self._staged.unlink(missing_ok=True)
            self._staged = None

    def __enter__(self) -> StagedFile:  # noqa: PYI034  (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def stage_file(path: Path, data: bytes) -> StagedFile:
    """Write `data` to a temporary file beside `path` (synced to disk).

    Raises:
        OutputError: the write failed (a full disk, a quota, an I/O error); nothing is left.
    """
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                   dir=path.resolve().parent)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs get ordinary permissions
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
        raise
    return StagedFile(path, Path(tmp))


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path`.

    Raises:
        OutputError: the write failed; `path` is unchanged and no temporary file is left.
    """
    stage_file(path, data).commit()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def sha256_of_file(path: Path, *, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()
