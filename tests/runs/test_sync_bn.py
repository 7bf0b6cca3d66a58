"""hvdtrain.layers.SyncBatchNormalization: batch statistics over the global batch.

On 2 ranks (horovodrun --gloo, uneven batches of 5 and 11 examples) its forward statistics,
its outputs and, after SGD steps, the weights and moving statistics equal one process's
BatchNormalization at the global batch of 16, to 1e-5; in inference it runs no collective;
in one process it is BatchNormalization, to the bit. Then through a Task and through hk.fit on
2 ranks: ranks identical, and the weights of one process at the global batch.
"""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import usercode
from conftest import KERAS2, result, run, script_cmd

# argv: out_prefix. Rank r takes its rows of a fixed global batch (5 and 11 on 2 ranks, all 16
# alone) through a SyncBatchNormalization model; beside it, locally (no collective), a
# BatchNormalization model on the whole global batch (one process's reference) and one on
# the rank's rows alone (per-rank BN: what SyncBN must not be). Writes out_prefix<rank>.json.
EXACT = textwrap.dedent("""
import json, sys
import numpy as np
import tensorflow as tf
import hvdtrain
from hvdtrain.compat import is_keras3, keras
from hvdtrain.layers import SyncBatchNormalization
from hvdtrain.distributed.optimizer import apply_gradients

k = keras()
world = hvdtrain.world()
SIZES = [5, 11] if world.size == 2 else [16]  # uneven: the count must come from the ranks
N = sum(SIZES)
rng = np.random.default_rng(0)
X = (rng.normal(size=(N, 4, 4, 2)) * 3 + 2).astype("float32")
Y = rng.integers(0, 3, size=N).astype("int64")
lo = sum(SIZES[:world.rank])
mine = slice(lo, lo + SIZES[world.rank])


def BN(**kw):  # Keras 2's fused kernel (its default on 4-D inputs) updates the moving
    # variance with the unbiased variance; SyncBatchNormalization is the unfused layer
    if not is_keras3():
        kw["fused"] = False
    return k.layers.BatchNormalization(**kw)


def build(bn):
    k.utils.set_random_seed(1)
    return k.Sequential([k.Input((4, 4, 2)), k.layers.Conv2D(3, 3, padding="same"),
                         bn(momentum=0.5), k.layers.Activation("relu"), k.layers.Flatten(),
                         k.layers.Dense(6), bn(momentum=0.5), k.layers.Activation("relu"),
                         k.layers.Dense(3)])


def horovod_ops(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sorted(n.op for n in nodes if n.op.startswith("Horovod"))


def stats(model):  # the first forward's batch statistics, from the moving ones (momentum 0.5)
    out = []
    for layer in model.layers:
        if "batch_normalization" in layer.name:
            mean, var = [np.asarray(w) for w in layer.get_weights()[2:]]
            out += [2 * mean, 2 * var - 1]  # moving = 0.5 * initial (0, 1) + 0.5 * batch
    return out


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


sync, plain, local = build(SyncBatchNormalization), build(BN), build(BN)
forward = tf.function(lambda m, x: m(x, training=True))
out = {"types": sorted({type(l).__name__ for l in sync.layers})}
y_sync = forward(sync, tf.constant(X[mine]))
y_plain = forward(plain, tf.constant(X))
y_local = forward(local, tf.constant(X[mine]))  # per-rank BN: what SyncBN must not be
out["stats"] = diff(stats(sync), stats(plain))
out["stats_local"] = diff(stats(local), stats(plain))
out["outputs"] = diff([y_sync], [np.asarray(y_plain)[mine]])
out["outputs_local"] = diff([y_local], [np.asarray(y_plain)[mine]])

spec = tf.TensorSpec((None, 4, 4, 2), tf.float32)
out["ops_inference"] = horovod_ops(lambda x: sync(x, training=False), spec)
before = [np.asarray(v) for v in sync.weights]
y_infer = sync(tf.constant(X[mine]), training=False)
y_infer_plain = plain(tf.constant(X[mine]), training=False)
out["inference"] = diff([y_infer], [y_infer_plain])
out["inference_moved"] = diff(before, [np.asarray(v) for v in sync.weights])

# Masked time steps (a Masking layer's mask) are not counted: sequences with padding.
S = np.where(rng.random(size=(N, 5, 1)) < 0.3, 0.0, rng.normal(size=(N, 5, 3)) + 1.0)
S = S.astype("float32")


def masked(bn):
    k.utils.set_random_seed(1)
    return k.Sequential([k.Input((5, 3)), k.layers.Masking(0.0), bn(momentum=0.5)])


m_sync, m_plain, m_local = masked(SyncBatchNormalization), masked(BN), masked(BN)
forward(m_sync, tf.constant(S[mine]))
forward(m_plain, tf.constant(S))
forward(m_local, tf.constant(S[mine]))
out["masked"] = diff(stats(m_sync), stats(m_plain))
out["masked_local"] = diff(stats(m_local), stats(m_plain))

# A few SGD steps: each rank's loss is its share of the global batch's mean loss, so that
# the averaged gradients are the global batch's (uneven batches).
opt = hvdtrain.DistributedOptimizer(k.optimizers.SGD(0.1))
ref_opt = k.optimizers.SGD(0.1)


def loss_of(model, x, y, share):
    losses = k.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)
    return tf.reduce_sum(losses) * share


def make_step(model, optimizer, share):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y, share)
        grads = tape.gradient(loss, model.trainable_variables)
        apply_gradients(optimizer, grads, model.trainable_variables)
        return loss
    return tf.function(step)


sync_step = make_step(sync, opt, world.size / N)
plain_step = make_step(plain, ref_opt, 1.0 / N)
out["ops_train"] = horovod_ops(sync_step, spec, tf.TensorSpec((None,), tf.int64))
for _ in range(4):
    sync_step(tf.constant(X[mine]), tf.constant(Y[mine]))
    plain_step(tf.constant(X), tf.constant(Y))
out["trainable"] = diff(sync.trainable_weights, plain.trainable_weights)
out["moving"] = diff(sync.non_trainable_weights, plain.non_trainable_weights)
out["trained"] = diff(sync.trainable_weights, build(BN).trainable_weights)
out["gamma_grad_seen"] = bool(diff([sync.layers[1].gamma], [np.ones(3)]) > 0)
with open(f"{sys.argv[1]}{world.rank}.json", "w") as f:
    json.dump(out, f)
""")

# The BN tests' data, model and Task (tests/usercode.py), with SyncBatchNormalization.
COMMON = usercode.bn_common("hvdtrain.SyncBatchNormalization()")
TASK = usercode.bn_task("syncbn", learning_rate=0.05, batch_size=16, epochs=1, checkpoint_every=10)
# argv: run_dir batch_size (per rank)
FIT = textwrap.dedent("""
    import sys
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    import common

    hk.init()
    x, y, x_test, y_test = common.data()
    model = common.model()
    model.compile(optimizer=hk.DistributedOptimizer(keras().optimizers.SGD(0.05)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    try:
        hk.fit(model, hk.dataset(x, y, batch_size=int(sys.argv[2]), seed=1), epochs=1,
               validation_data=(x_test, y_test), run_dir=sys.argv[1], checkpoint_every=10,
               verbose=2)
    except hk.Error as e:
        sys.exit(hk.report_error(e))
""")


@pytest.fixture
def code(tmp_path):
    return usercode.write(
        tmp_path, {"exact": EXACT, "common": COMMON, "bn_task": TASK, "bn_fit": FIT}
    )


env_with, two_ranks = usercode.env_with, usercode.two_ranks


def exact(code, tmp_path, np_):
    prefix = str(tmp_path / "out")
    p = run(script_cmd(np_, code / "exact.py", prefix), env_with(code, tmp_path), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    outs = []
    for rank in range(np_):
        with open(f"{prefix}{rank}.json") as f:
            outs.append(json.load(f))
    return outs


@pytest.mark.keras2
def test_two_ranks_uneven_batches_give_one_process_at_the_global_batch(code, tmp_path):
    for out in exact(code, tmp_path, 2):
        # Forward: the batch statistics and the outputs are the global batch's ...
        assert out["stats"] < 1e-5 and out["outputs"] < 1e-5, out
        # ... where per-rank BN's are far off (the test can fail).
        assert out["stats_local"] > 0.1 and out["outputs_local"] > 0.1, out
        # 4 SGD steps through hvdtrain.DistributedOptimizer: the one-process weights and
        # moving statistics, and the weights did move.
        assert out["trainable"] < 1e-5 and out["moving"] < 1e-5, out
        assert out["trained"] > 1e-2 and out["gamma_grad_seen"], out
        # One allreduce per layer in the forward pass and one in the backward, beside the
        # gradients' grouped allreduce; none in inference, which uses the moving statistics.
        assert out["ops_train"] == ["HorovodAllreduce"] * 4 + ["HorovodGroupedAllreduce"]
        assert out["ops_inference"] == [] and out["inference"] < 1e-5
        assert out["inference_moved"] == 0.0
        # Masked entries are left out of the count and the sums alike.
        assert out["masked"] < 1e-5 < 0.1 < out["masked_local"], out
        # It saves, and shows, as Keras' BatchNormalization.
        assert "BatchNormalization" in out["types"]


@pytest.mark.keras2
def test_one_process_is_batch_normalization_to_the_bit(code, tmp_path):
    (out,) = exact(code, tmp_path, 1)
    assert out["stats"] == out["outputs"] == out["trainable"] == out["moving"] == 0.0, out
    assert out["masked"] == 0.0
    assert out["ops_train"] == [] and out["ops_inference"] == []
    assert out["trained"] > 1e-2


def saved_weights(run_dir):
    """model.keras, loaded in this process without hvdtrain.layers: a plain Keras model."""
    from hvdtrain.compat import keras

    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    assert [type(l).__name__ for l in model.layers][1] == "BatchNormalization"
    assert type(model.layers[1]) is keras().layers.BatchNormalization
    return [np.asarray(w) for w in model.get_weights()]


def assert_same_weights(two, one):
    a, b = saved_weights(two), saved_weights(one)
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert not np.allclose(a[4], 0.0)  # the moving mean moved


@pytest.mark.keras2
def test_task_two_ranks_identical_and_one_process_at_the_global_batch(code, tmp_path):
    env = env_with(code, tmp_path)
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    task = ["-m", "hvdtrain", "run", "bn_task:BN"]
    p = run(two_ranks(*task, "--run-dir", two, "--batch-size", 8), env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run([sys.executable, *task, "--run-dir", one, "--batch-size", "16"], env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = result(two), result(one)
    assert a["ranks_identical"] is True and a["global_step"] == b["global_step"] == 32
    assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
    assert_same_weights(two, one)


@pytest.mark.keras2
def test_fit_two_ranks_identical_and_one_process_at_the_global_batch(code, tmp_path):
    env = env_with(code, tmp_path)
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    p = run(two_ranks(code / "bn_fit.py", two, 8), env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(script_cmd(1, code / "bn_fit.py", one, 16), env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = result(two), result(one)
    assert a["ranks_identical"] is True and a["global_step"] == b["global_step"] == 32
    assert_same_weights(two, one)


@pytest.mark.keras2
@pytest.mark.skipif(not KERAS2, reason="Keras 2's own arguments")
def test_keras2_refuses_the_fused_kernel_and_ghost_batches():
    from hvdtrain.layers import SyncBatchNormalization

    with pytest.raises(ValueError, match="fused=True"):
        SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="virtual_batch_size"):
        SyncBatchNormalization(virtual_batch_size=2)
    assert SyncBatchNormalization().fused is False
