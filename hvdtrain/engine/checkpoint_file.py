"""Checkpoints: one self-verifying file per save, written atomically by rank 0.

File ``ckpt-<global step>.hvdt``, format version 2:
    b"HVDTCKPT" | format version (1 byte) | metadata length (8 bytes, big-endian)
    | metadata JSON | payload (an uncompressed npz of the variables, in order)
    | sha256 of everything before it (32 bytes)
The metadata holds the payload's length, the variables' names, shapes and dtypes, the
training position and the settings that define the run. The trailing hash covers the whole
file, metadata included: one flipped bit in the epoch or the step is detected like one in
the weights. A save goes to a temporary file that is flushed and fsynced, then renamed, so
a crash leaves the previous checkpoint intact; on load, a file whose length or hash does not
match is skipped with a warning in favour of the one before it, and so is one whose hash
matches but whose contents do not (a file made by hand, or by a bug): the metadata (a step
>= 0, each variable's name, shape and a numeric dtype) and every array's header and size in
the payload are checked against each other before any array is allocated. A save first
removes the temporary files of saves that were killed (``.ckpt-*.tmp``).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
import struct
import zipfile
from collections.abc import Callable, Sequence

import numpy as np

from hvdtrain.base import files
from hvdtrain.base.errors import CheckpointError
from hvdtrain.base.files import atomic_open, make_dirs, writing

MAGIC = b"HVDTCKPT"
VERSION = 2  # 1 (hvdtrain 0.1) hashed the payload only
DIGEST = 32  # sha256
PATTERN = re.compile(r"ckpt-(\d+)\.hvdt$")


def path_for(directory: str, global_step: int) -> str:
    return os.path.join(directory, f"ckpt-{global_step:09d}.hvdt")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(global step, path), newest first."""
    found = []
    for path in glob.glob(os.path.join(directory, "ckpt-*.hvdt")):
        m = PATTERN.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def remove_leftovers(directory: str) -> None:
    """Delete the temporary files of saves that were killed before their rename (only rank
    0 writes, one save at a time: any such file is a leftover)."""
    files.remove_leftovers(directory, patterns=(".ckpt-*.hvdt.*.tmp",))


def save(
    directory: str, arrays: Sequence[np.ndarray], names: Sequence[str], meta: dict, keep: int
) -> str:
    """Write one checkpoint atomically, then delete all but the newest ``keep``. An OSError
    (disk full, read-only, a file named like the directory) is ``StorageError`` naming the
    checkpoint; the checkpoints before it stay as they were."""
    target = path_for(directory, meta["global_step"])
    with writing(target):
        make_dirs(directory)
        remove_leftovers(directory)
    buf = io.BytesIO()
    np.savez(buf, *arrays)
    payload = buf.getvalue()
    meta = dict(
        meta,
        payload_bytes=len(payload),
        variables=[[n, list(a.shape), str(a.dtype)] for n, a in zip(names, arrays)],
    )
    header = json.dumps(meta, sort_keys=True).encode()
    body = MAGIC + bytes([VERSION]) + struct.pack(">Q", len(header)) + header + payload
    with atomic_open(target, "wb") as f:  # a crash leaves the previous checkpoint intact
        f.write(body)
        f.write(hashlib.sha256(body).digest())
    for _, old in list_checkpoints(directory)[keep:]:
        with writing(old):
            os.unlink(old)
    return target


def read(path: str) -> tuple[dict, list[np.ndarray]]:
    """Metadata and arrays of one checkpoint; CheckpointError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    head = len(MAGIC) + 1 + 8
    if len(raw) < head or raw[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not an hvdtrain checkpoint (bad header)")
    if raw[len(MAGIC)] != VERSION:
        raise CheckpointError(f"{path}: format version {raw[len(MAGIC)]}, expected {VERSION}")
    if len(raw) < head + DIGEST:
        raise CheckpointError(f"{path}: truncated: {len(raw)} bytes")
    body, digest = raw[:-DIGEST], raw[-DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        # Truncation shows as a mismatch too; say which when the length gives it away.
        (meta_len,) = struct.unpack(">Q", raw[len(MAGIC) + 1 : head])
        try:
            want = head + meta_len + json.loads(raw[head : head + meta_len])["payload_bytes"]
        except (ValueError, KeyError, TypeError):
            want = None
        if want is not None and len(body) < want:
            raise CheckpointError(f"{path}: truncated: {len(raw)} bytes, expected {want + DIGEST}")
        raise CheckpointError(f"{path}: checksum mismatch (the file was altered)")
    (meta_len,) = struct.unpack(">Q", body[len(MAGIC) + 1 : head])
    try:
        meta = json.loads(body[head : head + meta_len])
        payload = body[head + meta_len :]
        if len(payload) != meta["payload_bytes"]:
            raise ValueError
    except (ValueError, KeyError, TypeError):  # hashed as written, so a bug, not damage
        raise CheckpointError(f"{path}: inconsistent metadata") from None
    problem = _check_contents(meta, payload)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = [npz[f"arr_{i}"] for i in range(len(meta["variables"]))]
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as e:  # checked above: a bug
        raise CheckpointError(f"{path}: unreadable arrays ({e})") from None
    return meta, arrays


def _check_contents(meta, payload: bytes) -> str | None:
    """What is wrong with a checkpoint whose hash matches (made by hand, or by a bug), before
    anything is allocated: None if the metadata and the payload's arrays agree."""
    if not isinstance(meta, dict):
        return "inconsistent metadata (not an object)"
    step = meta.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"inconsistent metadata (global_step {step!r}: not a count)"
    variables = meta.get("variables")
    if not isinstance(variables, list):
        return "inconsistent metadata (no variables list)"
    wanted = {}
    for i, v in enumerate(variables):
        try:
            name, shape, dtype = v
            shape = tuple(shape)
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError
            dtype = np.dtype(dtype)
        except (ValueError, TypeError):
            return f"inconsistent metadata (variable {i}: {v!r})"
        if dtype.kind not in "biufc":
            return f"variable {i} ({name}): dtype {dtype} is not a number type"
        wanted[f"arr_{i}.npy"] = (name, shape, dtype)
    try:
        archive = zipfile.ZipFile(io.BytesIO(payload))
        members = {m.filename: m for m in archive.infolist()}
    except (zipfile.BadZipFile, ValueError) as e:
        return f"payload is not an npz archive ({e})"
    missing = sorted(set(wanted) - set(members), key=lambda m: int(m[4:-4]))
    if missing:
        return f"payload lacks {len(missing)} of the {len(wanted)} arrays ({missing[0]}, ...)"
    for member, (name, shape, dtype) in wanted.items():
        try:
            with archive.open(members[member]) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    header = np.lib.format.read_array_header_1_0(f)
                else:
                    header = np.lib.format.read_array_header_2_0(f)
                offset = f.tell()
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
            return f"{member} ({name}): unreadable array header ({e})"
        got_shape, _, got_dtype = header
        if got_dtype.kind not in "biufc":
            return f"{member} ({name}): dtype {got_dtype} is not a number type"
        if tuple(got_shape) != shape or got_dtype != dtype:
            return (
                f"{member} ({name}): array {got_dtype}{list(got_shape)} where the metadata "
                f"says {dtype}{list(shape)}"
            )
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if members[member].file_size != offset + size:
            return (
                f"{member} ({name}): {members[member].file_size - offset} bytes of data for {size}"
            )
    return None


def load_latest(directory: str, warn: Callable[[str], None]) -> tuple[dict, list, str] | None:
    """The newest checkpoint that verifies, warning about each newer one that does not.

    None when the directory holds no checkpoint; CheckpointError when it holds only bad ones.
    """
    candidates = list_checkpoints(directory)
    problems = []
    for _, path in candidates:
        try:
            meta, arrays = read(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            warn(f"hvdtrain: warning: {problem}; resuming from {os.path.basename(path)} instead")
        return meta, arrays, path
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
