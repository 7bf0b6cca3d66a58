"""A large Embedding trained with Adam, by hk.fit and by a Task: tests/runs/test_sparse_gradients.py
runs this file on 2 ranks (``python sparse_gradients.py OUT NAME...``), each scenario with
its own Horovod timeline (HOROVOD_TIMELINE=DYNAMIC), and imports it in one process for the
references. Each run leaves RUN_DIR/weights.npz (rank 0) and a timeline, RUN_DIR.timeline.json.

The ids are 64 rows spread over the 1,000,000-row table, so a batch repeats rows, and so do
the two ranks' batches: the case where a sparse gradient's update differs from the dense one's.
"""

import json
import os
import sys

import numpy as np

import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.compat import keras
from hvdtrain.data import Data

k = keras()
ROWS, COLUMNS, IDS = 1_000_000, 16, 4  # the table; ids per example
STEPS = 8  # updates per run: 8 x 32 examples, one epoch


def data(rows=ROWS):
    rng = np.random.default_rng(11)
    x = (rng.integers(0, 64, size=(STEPS * 32, IDS)) * (rows // 64) + 7).astype("int32")
    return x, (x[:, 0] < rows // 2).astype("int64")


def model(rows=ROWS):
    k.utils.set_random_seed(5)
    return k.Sequential(
        [
            k.Input((IDS,), dtype="int32"),
            k.layers.Embedding(rows, COLUMNS),
            k.layers.GlobalAveragePooling1D(),
            k.layers.Dense(2, activation="softmax"),
        ]
    )


def embedding_only(rows=ROWS):
    """A model whose one trainable variable is the Embedding: every gradient is sparse."""
    k.utils.set_random_seed(5)
    return k.Sequential(
        [
            k.Input((IDS,), dtype="int32"),
            k.layers.Embedding(rows, 2),
            k.layers.GlobalAveragePooling1D(),
            k.layers.Activation("softmax"),
        ]
    )


def save(run_dir, m):
    if hk.rank() == 0:
        np.savez(os.path.join(run_dir, "weights.npz"), *m.get_weights())


def fit(run_dir, batch_size=16, build=model, rows=ROWS):
    """hk.fit: Keras' own train step, the optimizer's reduction (Keras 3) or Horovod's
    wrapper (Keras 2)."""
    x, y = data(rows)
    m = build(rows)
    m.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.Adam(1e-2)),
        loss="sparse_categorical_crossentropy",
        jit_compile=False,
    )
    hk.fit(
        m,
        hk.dataset(x, y, batch_size=batch_size, seed=3),
        epochs=1,
        run_dir=run_dir,
        checkpoint_every=0,
        save_model=False,
        verbose=0,
    )
    save(run_dir, m)


def fit_only_sparse(run_dir, batch_size=16):
    """hk.fit of a model with no dense gradient: the step's stop flags go in a round of
    their own."""
    fit(run_dir, batch_size, embedding_only)


def fit_small_table(run_dir, batch_size=16):
    """hk.fit of a 100-row table: 2 ranks x 64 rows looked up are more than its rows."""
    fit(run_dir, batch_size, rows=100)


class Embed(hvdtrain.Task):
    name = "embed"

    def load_data(self, config, world):
        x, y = data()
        return Data(x, y, x[:32], y[:32])

    def build_model(self, config):
        self.model = model()  # kept for save()
        return self.model

    def build_optimizer(self, config, learning_rate):
        return k.optimizers.Adam(1e-2)

    def loss(self, y, pred):
        return k.losses.sparse_categorical_crossentropy(y, pred)


def task(run_dir, batch_size=16):
    """The Task path: hvdtrain's step and the optimizer's reduction, under either Keras."""
    t = Embed()
    hvdtrain.train(
        t,
        hvdtrain.Config(
            run_dir=run_dir,
            epochs=1,
            batch_size=batch_size,
            checkpoint_every=0,
            save_model=False,
            verbose=0,
        ),
        hvdtrain.world(),
    )
    save(run_dir, t.model)


def task_dense(run_dir, batch_size=16):
    """The Task path with HVDTRAIN_SPARSE_AS_DENSE_RATIO=0: the Embedding's gradient dense."""
    os.environ["HVDTRAIN_SPARSE_AS_DENSE_RATIO"] = "0"
    try:
        task(run_dir, batch_size)
    finally:
        del os.environ["HVDTRAIN_SPARSE_AS_DENSE_RATIO"]


def slices(rank):
    """A rank's sparse gradient of a [10, 3] variable: rows repeated within and across ranks."""
    values = np.random.default_rng(rank).normal(size=(4, 3)).astype("float32")
    return values, np.array([[1, 3, 3, 7], [3, 5, 1, 1]][rank], "int32")


def reductions(run_dir):
    """The world's reduction of a sparse gradient, gathered (ratio inf) and dense (ratio 0),
    for each op, predivide factor and compression: its largest distance from the dense
    gradient of both ranks' rows, computed here."""
    import tensorflow as tf

    os.makedirs(run_dir, exist_ok=True)
    world = hvdtrain.world()
    values, indices = slices(hk.rank())
    grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([10, 3]))
    expected = np.zeros((10, 3), "float32")
    for r in range(2):
        np.add.at(expected, slices(r)[1], slices(r)[0])
    out = {}
    for op, factor, compression in (
        ("average", 1.0, "none"),
        ("average", 4.0, "none"),
        ("sum", 1.0, "none"),
        ("average", 1.0, "fp16"),
    ):
        want = expected / 2 if op == "average" else expected
        for way, ratio in (("gathered", float("inf")), ("dense", 0.0)):
            (reduced,) = world.allreduce_gradients([grad], op, compression, factor, ratio)
            out[f"{op} {factor:g} {compression} {way}"] = [
                type(reduced).__name__,
                float(np.abs(np.asarray(reduced) - want).max()),
            ]
    with open(os.path.join(run_dir, f"reductions.rank{hk.rank()}.json"), "w") as f:
        json.dump(out, f)


def main(out, names):
    import horovod.tensorflow as hvd

    hk.init()
    for name in names:
        run_dir = os.path.join(out, name)
        hvd.start_timeline(run_dir + ".timeline.json")  # rank 0 writes it
        try:
            globals()[name](run_dir)
            outcome = {"ok": True}
        except Exception as e:  # noqa: BLE001 (the test that asks for this scenario fails on it)
            outcome = {"crash": f"{type(e).__name__}: {e}"}
        hvd.stop_timeline()
        with open(os.path.join(out, f"{name}.rank{hk.rank()}.json"), "w") as f:
            json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
