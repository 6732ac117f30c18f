"""Output files: checked before any work starts, written whole or not at all."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from qcal.numerics.errors import OutputError

__all__ = ["check_output_path", "sha256_of_file", "write_atomic"]


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
    if resolved.exists() and not force:
        raise OutputError(f"{what} {path}: already exists (use --force to overwrite)")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.resolve().parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs get ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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
