"""Files that readers see whole or not at all: write beside, fsync, rename, fsync the folder;
JSON that stays valid (NaN and infinities as null), written so.

A write that fails (disk full, a read-only file system, a file where a directory belongs) is
``StorageError``: one line naming the file and the OS's reason (``writing``).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import math
import os
import tempfile

from hvdtrain.base.errors import StorageError, first_line

# TensorFlow's file errors give the OS's reason as text: its number, for the same line.
ERRNO_OF = {os.strerror(n): n for n in sorted(errno.errorcode, reverse=True)}


def os_reason(e: BaseException) -> str:
    """``[Errno 28] No space left on device`` of an OSError, or of a TensorFlow file error
    ("PATH; No space left on device")."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"[Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
    text = str(getattr(e, "message", e))
    for reason, number in ERRNO_OF.items():
        if reason in text:
            return f"[Errno {number}] {reason}"
    return first_line(text)


def cannot_write(path: str, e: BaseException) -> StorageError:
    return StorageError(f"cannot write {path}: {os_reason(e)}")


@contextlib.contextmanager
def writing(path: str, also=()):
    """Turn an OSError (and any of ``also``) of the block into ``StorageError`` naming
    ``path``."""
    try:
        yield
    except StorageError:
        raise
    except (OSError,) + tuple(also) as e:
        raise cannot_write(path, e) from None


def make_dirs(directory: str) -> None:
    """``os.makedirs(directory, exist_ok=True)``; a file in its place is ENOTDIR, as opening a
    file under it would say (not makedirs' "File exists")."""
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory) from None


def remove_leftovers(directory: str, patterns=(".*.tmp", ".*.keras", ".*.weights.h5")) -> None:
    """Delete the temporary files of writes that were killed before their rename (``replacing``
    names them ``.NAME.RANDOM.SUFFIX``; only rank 0 writes, one file at a time: any such file
    is a leftover)."""
    for pattern in patterns:
        for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass


@contextlib.contextmanager
def replacing(path: str, suffix: str = ".tmp"):
    """Yield a temporary path beside ``path``; when the block ends without an error, the
    temporary file (written by the block, by any means) replaces ``path`` atomically.

    A crash or an error leaves ``path`` as it was and removes the temporary file; an
    OSError is ``StorageError`` naming ``path``.
    ``suffix``: the temporary file's (Keras saves only to ``*.keras``).
    """
    directory = os.path.dirname(path) or "."
    with writing(path):
        fd, tmp = tempfile.mkstemp(
            dir=directory, prefix="." + os.path.basename(path) + ".", suffix=suffix
        )
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the rest of the team
        os.close(fd)
        with writing(path):
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(directory)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


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


def finite_json(obj):
    """``obj`` with NaN and infinities as null: result.json and metrics stay valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    with atomic_open(path) as f:
        json.dump(finite_json(obj), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
