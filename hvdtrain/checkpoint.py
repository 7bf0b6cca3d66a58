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
match is skipped with a warning in favour of the one before it.
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
import struct
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from hvdtrain.errors import CheckpointError
from hvdtrain.files import atomic_open

MAGIC = b"HVDTCKPT"
VERSION = 2  # 1 (hvdtrain 0.1) hashed the payload only
DIGEST = 32  # sha256
PATTERN = re.compile(r"ckpt-(\d+)\.hvdt$")


def path_for(directory: str, global_step: int) -> str:
    return os.path.join(directory, f"ckpt-{global_step:09d}.hvdt")


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """(global step, path), newest first."""
    found = []
    for path in glob.glob(os.path.join(directory, "ckpt-*.hvdt")):
        m = PATTERN.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def save(directory: str, arrays: Sequence[np.ndarray], names: Sequence[str], meta: dict,
         keep: int) -> str:
    """Write one checkpoint atomically, then delete all but the newest ``keep``."""
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, *arrays)
    payload = buf.getvalue()
    meta = dict(meta, payload_bytes=len(payload),
                variables=[[n, list(a.shape), str(a.dtype)] for n, a in zip(names, arrays)])
    header = json.dumps(meta, sort_keys=True).encode()
    target = path_for(directory, meta["global_step"])
    body = MAGIC + bytes([VERSION]) + struct.pack(">Q", len(header)) + header + payload
    with atomic_open(target, "wb") as f:  # a crash leaves the previous checkpoint intact
        f.write(body)
        f.write(hashlib.sha256(body).digest())
    for _, old in list_checkpoints(directory)[keep:]:
        os.unlink(old)
    return target


def read(path: str) -> Tuple[dict, List[np.ndarray]]:
    """Metadata and arrays of one checkpoint; CheckpointError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    head = len(MAGIC) + 1 + 8
    if len(raw) < head or raw[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not an hvdtrain checkpoint (bad header)")
    if raw[len(MAGIC)] != VERSION:
        raise CheckpointError(f"{path}: format version {raw[len(MAGIC)]}, expected {VERSION}")
    if len(raw) < head + DIGEST:
        raise CheckpointError(f"{path}: truncated: {len(raw)} bytes")
    body, digest = raw[:-DIGEST], raw[-DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        # Truncation shows as a mismatch too; say which when the length gives it away.
        (meta_len,) = struct.unpack(">Q", raw[len(MAGIC) + 1:head])
        try:
            want = head + meta_len + json.loads(raw[head:head + meta_len])["payload_bytes"]
        except (ValueError, KeyError, TypeError):
            want = None
        if want is not None and len(body) < want:
            raise CheckpointError(f"{path}: truncated: {len(raw)} bytes, expected "
                                  f"{want + DIGEST}")
        raise CheckpointError(f"{path}: checksum mismatch (the file was altered)")
    (meta_len,) = struct.unpack(">Q", body[len(MAGIC) + 1:head])
    try:
        meta = json.loads(body[head:head + meta_len])
        payload = body[head + meta_len:]
        if len(payload) != meta["payload_bytes"]:
            raise ValueError
    except (ValueError, KeyError, TypeError):  # hashed as written, so a bug, not damage
        raise CheckpointError(f"{path}: inconsistent metadata") from None
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        arrays = [npz[f"arr_{i}"] for i in range(len(meta["variables"]))]
    return meta, arrays


def load_latest(directory: str, warn: Callable[[str], None]) -> Optional[Tuple[dict, list, str]]:
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
