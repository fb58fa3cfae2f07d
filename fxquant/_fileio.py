"""Crash-safe file writes shared by capture shards, manifests, exports and checkpoints.

``write_atomic`` writes to ``NAME.tmp``, flushes and fsyncs it, renames it over ``NAME`` and (by default)
fsyncs the directory: after a crash a reader finds either the old file or the complete new one, never a
torn file under the final name. On any error the temporary file is removed and the error propagates.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], *, fsync_parent: bool = True) -> None:
    """Call ``write(f)`` on ``path.tmp`` opened for binary writing, then make it ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync_parent:
        fsync_dir(path.parent)
