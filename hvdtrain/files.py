"""Files that readers see whole or not at all: write beside, fsync, rename, fsync the folder."""
from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def replacing(path: str, suffix: str = ".tmp"):
    """Yield a temporary path beside ``path``; when the block ends without an error, the
    temporary file (written by the block, by any means) replaces ``path`` atomically.

    A crash or an error leaves ``path`` as it was and removes the temporary file.
    ``suffix``: the temporary file's (Keras saves only to ``*.keras``).
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                               suffix=suffix)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the rest of the team
        os.close(fd)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w"):
    """``open(path, mode)`` for writing, atomically (see ``replacing``)."""
    with replacing(path) as tmp, open(tmp, mode) as f:
        yield f


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
