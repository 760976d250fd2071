"""Writing a file so that a reader sees the old one or the new one, never a part: the one
atomic writer that fp4lab and experiments use (policy files, checkpoints, plots, records)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["atomic", "write_atomic"]


@contextlib.contextmanager
def atomic(path):
    """A temporary path beside ``path`` to write in the block; once the block succeeds its
    data is flushed to disk and it replaces ``path``; if the block fails it is removed.
    Created by the writer (``open``, ``write_bytes``, ``savefig``...), so with the ordinary
    umask-respecting mode."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path, content: str | bytes) -> None:
    """Replace ``path`` by ``content`` (text or bytes) atomically (:func:`atomic`)."""
    with atomic(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
