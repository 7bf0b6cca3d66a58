"""MNIST-format files for the tests: written (``write_idx``, ``make_idx_dir``) and damaged
(``corrupt``); the unit tests of the loaders and the 2-rank test of a corrupt file share them."""

import gzip
import os
import struct

import numpy as np

from hvdtrain.inputs import loaders as D


def write_idx(path, array, compress=True):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(
        ">" + "I" * array.ndim, *array.shape
    )
    raw = header + array.astype(np.uint8).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(raw)


def make_idx_dir(directory, n_train=60, n_test=20, compress=True):
    rng = np.random.default_rng(0)
    arrays = {
        "train": (rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 10, n_train)),
        "test": (rng.integers(0, 256, (n_test, 28, 28)), rng.integers(0, 10, n_test)),
    }
    for split, (xname, yname) in D.IDX_FILES.items():
        x, y = arrays[split]
        suffix = "" if compress else ".gz"
        write_idx(
            os.path.join(directory, xname.removesuffix(suffix) if not compress else xname),
            x,
            compress,
        )
        write_idx(
            os.path.join(directory, yname if compress else yname.removesuffix(".gz")), y, compress
        )
    return arrays


def corrupt(path, how):
    raw = open(path, "rb").read()
    if how == "truncate":
        raw = raw[: len(raw) // 2]
    elif how == "flip":
        mid = len(raw) // 2  # inside the deflate stream, past the header's file name
        raw = raw[:mid] + bytes([raw[mid] ^ 0xFF]) + raw[mid + 1 :]
    elif how == "empty":
        raw = b""
    open(path, "wb").write(raw)
