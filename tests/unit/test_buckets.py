"""The gradients' buckets (HorovodWorld.allreduce_gradients): cut from the last tensor to the
first by static size alone, and HVDTRAIN_BUCKET_BYTES read with a one-line refusal. Their
overlap with the backward pass, on 2 ranks: runs/test_overlap.py."""

import pytest

from hvdtrain.base.errors import EnvError
from hvdtrain.distributed.horovod_world import _buckets
from hvdtrain.distributed.world import BUCKET_BYTES, LAST_BUCKET_BYTES, configured_bucket_bytes


def test_buckets_are_cut_in_backward_order_by_static_size():
    import tensorflow as tf

    # float32: 8, 40,000, 40, 10,000, 12 bytes; the flags (riders) go in front
    tensors = [
        tf.zeros([2]),
        tf.zeros([100, 100]),
        tf.zeros([10]),
        tf.zeros([50, 50]),
        tf.zeros([3]),
    ]
    # the small ones (12, 40, 8 bytes) gather, the first tensors last, each large one alone
    # where the backward pass produces it: 10,000 bytes, a bucket's worth; 40,000 over 20,000
    assert _buckets(tensors, 10_000) == [[3], [1], [0, 2, 4]]
    assert _buckets(tensors, 10**6, alone_bytes=20_000) == [[1], [0, 2, 3, 4]]
    assert _buckets(tensors, 100, alone_bytes=20_000) == [[3], [1], [0, 2, 4]]
    assert _buckets(tensors, 1) == [[4], [3], [2], [1], [0]]
    assert _buckets(tensors, 0) == [[0, 1, 2, 3, 4]]  # 0: one grouped allreduce, whatever size
    assert _buckets(tensors, 10**9, alone_bytes=10**9) == [[0, 1, 2, 3, 4]]
    assert _buckets([], 10_000) == []
    # the front bucket's first tensors, up to last_bytes, go last on their own: two or more
    assert _buckets(tensors, 10**9, alone_bytes=10**9, last_bytes=40_048) == [[3, 4], [0, 1, 2]]
    assert _buckets(tensors, 10**9, alone_bytes=10**9, last_bytes=40_047) == [[2, 3, 4], [0, 1]]
    # the flags alone would be a round for nothing: they stay with the front bucket
    assert _buckets(tensors, 10**9, alone_bytes=10**9, last_bytes=39_999) == [[0, 1, 2, 3, 4]]
    # values do not matter, only shapes and dtypes: every rank cuts the same buckets
    other = [tf.ones_like(t) * 7 for t in tensors]
    assert _buckets(other, 10_000) == _buckets(tensors, 10_000)
    halves = [tf.zeros([3000], tf.float16), tf.zeros([3000], tf.float16), tf.zeros([3000])]
    assert _buckets(halves, 10_000) == [[2], [0, 1]]  # 12,000 bytes alone; 6,000 + 6,000
    assert _buckets(halves, 10_000, alone_bytes=10**9) == [[2], [0, 1]]  # bucket-sized: alone


def test_the_default_buckets_of_a_wide_mlp():
    """Its 4096 x 4096 and 1024 x 4096 kernels (67 and 17 MB) each alone, the biases and
    the 4096 x 10 kernel (170 KB) in one bucket with the flags riding in front."""
    import tensorflow as tf

    flags = tf.zeros([2])
    shapes = [[1024, 4096], [4096], [4096, 4096], [4096], [4096, 4096], [4096], [4096, 10], [10]]
    tensors = [flags] + [tf.zeros(s) for s in shapes]
    assert _buckets(tensors, BUCKET_BYTES) == [[5], [3], [1], [0, 2, 4, 6, 7, 8]]


def test_the_last_bucket_of_a_convolutional_net_is_its_first_megabyte():
    """Forty 3 x 3 x 64 x 64 kernels (147 KB each) and their biases: the last bucket only the
    flags, the stem and the first seven kernels (1 MiB at most), what the reduction leaves
    for after the backward pass; then a bucket of 4 MiB, and the last layers' 0.6 MB, the
    first bucket the backward pass completes."""
    import tensorflow as tf

    tensors = [tf.zeros([2]), tf.zeros([3, 3, 3, 64])]
    for _ in range(40):
        tensors += [tf.zeros([3, 3, 64, 64]), tf.zeros([64])]
    buckets = _buckets(tensors, BUCKET_BYTES)
    # 8 + 6,912 + 7 x (147,456 + 256) bytes; 28 x 147,712 + 147,456 = 4,283,392 (closed at
    # the kernel that reaches 4 MiB); the last bias and 4 x 147,712
    assert buckets == [list(range(73, 82)), list(range(16, 73)), list(range(16))]
    assert sum(tensors[i].shape.num_elements() * 4 for i in buckets[-1]) <= LAST_BUCKET_BYTES
    # a model under 4 MiB whose first kernel does not fit in the last megabyte: one bucket
    small = [
        tf.zeros([2]),
        tf.zeros([784, 1024]),
        tf.zeros([1024]),
        tf.zeros([1024, 10]),
        tf.zeros([10]),
    ]
    assert _buckets(small, BUCKET_BYTES) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("raw, value", [("", BUCKET_BYTES), ("0", 0), (" 1048576 ", 1 << 20)])
def test_bucket_bytes_setting(raw, value):
    assert configured_bucket_bytes({"HVDTRAIN_BUCKET_BYTES": raw}) == value


@pytest.mark.parametrize("raw", ["25MiB", "-1", "1.5"])
def test_a_bad_bucket_bytes_is_one_line_naming_it(raw):
    with pytest.raises(EnvError) as e:
        configured_bucket_bytes({"HVDTRAIN_BUCKET_BYTES": raw})
    assert str(e.value).startswith(f"HVDTRAIN_BUCKET_BYTES={raw.strip()}: ") and "\n" not in str(
        e.value
    )
