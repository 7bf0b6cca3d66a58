"""Loaders on real and corrupt files, the bundled sample, and the per-rank shard plan."""

import gzip
import os

import numpy as np
import pytest

from hvdtrain.distributed import World
from hvdtrain.inputs import arrays as A
from hvdtrain.inputs import loaders as D
from idx_files import corrupt, make_idx_dir, write_idx

# Data files and plans, in this process: the inner loop runs them.
pytestmark = pytest.mark.quick


@pytest.mark.parametrize("compress", [True, False])
def test_idx_directory_round_trip(tmp_path, compress):
    arrays = make_idx_dir(tmp_path, compress=compress)
    data = D.load_dir(str(tmp_path), "mnist")
    np.testing.assert_array_equal(data.x_train, arrays["train"][0])
    np.testing.assert_array_equal(data.y_test, arrays["test"][1])
    assert data.x_train.dtype == np.uint8 and data.x_test.shape == (20, 28, 28)


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 30, dtype=np.uint8)
    np.savez(tmp_path / "mnist.npz", x_train=x, y_train=y, x_test=x[:5], y_test=y[:5])
    data = D.load_dir(str(tmp_path), "mnist")
    assert len(data.x_train) == 30 and len(data.y_test) == 5


@pytest.mark.parametrize(
    "victim, how, message",
    [
        ("train-images-idx3-ubyte.gz", "truncate", "truncated gzip"),
        ("train-labels-idx1-ubyte.gz", "flip", "corrupt gzip"),
        ("t10k-images-idx3-ubyte.gz", "empty", "truncated"),
    ],
)
def test_corrupt_gzip_names_the_file(tmp_path, victim, how, message):
    make_idx_dir(tmp_path)
    corrupt(tmp_path / victim, how)
    with pytest.raises(D.DataError) as e:
        D.load_dir(str(tmp_path), "mnist")
    assert str(tmp_path / victim) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_truncated_raw_idx_says_by_how_much(tmp_path):
    make_idx_dir(tmp_path, compress=False)
    path = tmp_path / "train-images-idx3-ubyte"
    corrupt(path, "truncate")
    with pytest.raises(
        D.DataError,
        match=r"train-images-idx3-ubyte: truncated: \d+ bytes, "
        r"shape \(60, 28, 28\) needs 47056",
    ):
        D.load_dir(str(tmp_path), "mnist")


def test_wrong_magic_and_mismatched_counts(tmp_path):
    make_idx_dir(tmp_path)
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(b"PK\x03\x04 this is not idx")
    with pytest.raises(D.DataError, match="not an unsigned-byte IDX file"):
        D.load_dir(str(tmp_path), "mnist")
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(7))
    with pytest.raises(D.DataError, match="7 labels for 20 images"):
        D.load_dir(str(tmp_path), "mnist")


def test_missing_file_and_empty_dir(tmp_path):
    assert D.load_dir(str(tmp_path), "mnist") is None
    make_idx_dir(tmp_path)
    os.unlink(tmp_path / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(D.DataError, match=r"t10k-images-idx3-ubyte.gz: missing \(test split\)"):
        D.load_dir(str(tmp_path), "mnist")
    with pytest.raises(D.DataError, match="holds neither"):
        D.load_mnist_format("mnist", str(tmp_path / "nothing-here"), False, World())


def test_corrupt_npz(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(D.DataError, match=r"mnist.npz: not a readable npz file"):
        D.load_dir(str(tmp_path), "mnist")


def test_bundled_sample_split():
    data = D.load_sample()
    assert data.x_train.shape == (4000, 28, 28) and data.x_test.shape == (1000, 28, 28)
    assert np.bincount(data.y_train).tolist() == [400] * 10
    assert np.bincount(data.y_test).tolist() == [100] * 10
    assert data.x_train.max() == 255 and data.x_train.dtype == np.uint8
    # The held-out digits never appear in training.
    train_rows = {row.tobytes() for row in data.x_train}
    assert not any(row.tobytes() in train_rows for row in data.x_test)


def test_corrupt_sample_is_named(tmp_path):
    bad = tmp_path / "sample.csv.gz"
    bad.write_bytes(open(D.SAMPLE_PATH, "rb").read()[:5000])
    with pytest.raises(D.DataError, match="sample.csv.gz: truncated gzip"):
        D.load_sample(str(bad))


def test_fallback_to_sample_without_network_or_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "KERAS_CACHE", str(tmp_path / "cache"))
    notices = []
    data = D.load_mnist_format("mnist", None, False, World(), notices.append)
    assert data.info["dataset"] == "mnist_sample" and len(data.x_test) == 1000
    assert len(notices) == 1 and "bundled 5,000-digit sample" in notices[0]


def test_keras_cache_is_used_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "KERAS_CACHE", str(tmp_path))
    (tmp_path / "mnist.npz").write_bytes(b"not a zip")
    with pytest.raises(D.DataError, match="mnist.npz: not a readable npz"):
        D.load_mnist_format("mnist", None, False, World(), print)


@pytest.mark.parametrize(
    "n, batch, size", [(1000, 500, 2), (4000, 100, 2), (103, 10, 3), (60000, 100, 1)]
)
def test_epoch_plan_is_disjoint_equal_and_deterministic(n, batch, size):
    steps = A.steps_per_epoch(n, batch, size)
    plans = [A.epoch_plan(n, batch, r, size, seed=3, epoch=1) for r in range(size)]
    assert all(p.shape == (steps, batch) for p in plans)
    flat = np.concatenate([p.ravel() for p in plans])
    assert len(np.unique(flat)) == len(flat) == steps * batch * size
    np.testing.assert_array_equal(plans[0], A.epoch_plan(n, batch, 0, size, seed=3, epoch=1))
    assert not np.array_equal(plans[0], A.epoch_plan(n, batch, 0, size, seed=3, epoch=2))


def test_global_batches_do_not_depend_on_world_size():
    """Step k covers the same examples with 1 worker x 200 or 2 workers x 100."""
    one = A.epoch_plan(4000, 200, 0, 1, seed=5, epoch=0)
    two = [A.epoch_plan(4000, 100, r, 2, seed=5, epoch=0) for r in range(2)]
    np.testing.assert_array_equal(one, np.concatenate(two, axis=1))


def test_test_shards_cover_every_example_once():
    parts = [A.test_shard(1001, r, 3) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1001))


def keras_npz(path, **change):
    """A small Keras-format mnist.npz; ``change`` replaces arrays."""
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 20).astype(np.uint8),
        x_test=rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 10).astype(np.uint8),
    )
    arrays.update(change)
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "change, message",
    [
        # Images scaled to [0, 1]: cast to bytes they would all be 0 and train to chance.
        (
            dict(x_train=np.random.default_rng(1).random((20, 28, 28), dtype=np.float32)),
            r"mnist.npz: x_train are float32 \(values \S+\.\.0\.\d+\); MNIST-format pixels are "
            r"integers 0-255",
        ),
        (
            dict(x_test=np.full((10, 28, 28), 300, np.int32)),
            r"pixel value 300 outside 0-255 in x_test",
        ),
        (dict(y_train=np.full(20, 10, np.int64)), r"mnist.npz: label 10 outside 0-9 in y_train"),
        (dict(y_test=np.full(10, -1, np.int64)), r"mnist.npz: label -1 outside 0-9 in y_test"),
        (dict(y_train=np.zeros(20, np.float32)), r"y_train are float32; expected integer classes"),
        (
            dict(y_train=np.zeros((20, 10), np.uint8)),
            r"y_train have shape \(20, 10\), expected one",
        ),
    ],
)
def test_npz_values_are_checked_not_cast(tmp_path, change, message):
    keras_npz(tmp_path / "mnist.npz", **change)
    with pytest.raises(D.DataError, match=message):
        D.load_dir(str(tmp_path), "mnist")


def test_npz_with_good_values_loads_exactly(tmp_path):
    keras_npz(tmp_path / "mnist.npz", y_train=np.arange(20, dtype=np.int64) % 10)
    data = D.load_dir(str(tmp_path), "mnist")
    assert data.x_train.dtype == np.uint8 and data.y_train.tolist() == list(range(10)) * 2
