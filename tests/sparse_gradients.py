"""A large Embedding trained with Adam, by hk.fit and by a Task: tests/runs/test_sparse_gradients.py
runs this file on 2 ranks (``python sparse_gradients.py OUT NAME...``), each scenario with
its own Horovod timeline (HOROVOD_TIMELINE=DYNAMIC), and imports it in one process for the
references. Each run leaves RUN_DIR/weights.npz (rank 0) and a timeline, RUN_DIR.timeline.json.

The ids are 64 rows spread over the 1,000,000-row table, so a batch repeats rows, and so do
the two ranks' batches: the case where a sparse gradient's update differs from the dense one's.
"""
import json, os, sys
import numpy as np
import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.compat import keras
from hvdtrain.data import Data

k = keras()
ROWS, COLUMNS, IDS = 1_000_000, 16, 4  # the table; ids per example
STEPS = 8  # updates per run: 8 x 32 examples, one epoch

def data():
    rng = np.random.default_rng(11)
    x = (rng.integers(0, 64, size=(STEPS * 32, IDS)) * (ROWS // 64) + 7).astype("int32")
    return x, (x[:, 0] < ROWS // 2).astype("int64")

def model():
    k.utils.set_random_seed(5)
    return k.Sequential([k.Input((IDS,), dtype="int32"), k.layers.Embedding(ROWS, COLUMNS),
                         k.layers.GlobalAveragePooling1D(),
                         k.layers.Dense(2, activation="softmax")])

def embedding_only():
    '''A model whose one trainable variable is the Embedding: every gradient is sparse.'''
    k.utils.set_random_seed(5)
    return k.Sequential([k.Input((IDS,), dtype="int32"), k.layers.Embedding(ROWS, 2),
                         k.layers.GlobalAveragePooling1D(), k.layers.Activation("softmax")])

def save(run_dir, m):
    if hk.rank() == 0:
        np.savez(os.path.join(run_dir, "weights.npz"), *m.get_weights())

def fit(run_dir, batch_size=16, build=model):
    '''hk.fit: Keras' own train step, the optimizer's reduction (Keras 3) or Horovod's
    wrapper (Keras 2).'''
    x, y = data()
    m = build()
    m.compile(optimizer=hk.DistributedOptimizer(k.optimizers.Adam(1e-2)),
              loss="sparse_categorical_crossentropy", jit_compile=False)
    hk.fit(m, hk.dataset(x, y, batch_size=batch_size, seed=3), epochs=1, run_dir=run_dir,
           checkpoint_every=0, save_model=False, verbose=0)
    save(run_dir, m)

def fit_only_sparse(run_dir, batch_size=16):
    '''hk.fit of a model with no dense gradient: the step's stop flags go in a round of
    their own.'''
    fit(run_dir, batch_size, embedding_only)

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
    '''The Task path: hvdtrain's step and the optimizer's reduction, under either Keras.'''
    t = Embed()
    hvdtrain.train(t, hvdtrain.Config(run_dir=run_dir, epochs=1, batch_size=batch_size,
                                      checkpoint_every=0, save_model=False, verbose=0),
                   hvdtrain.world())
    save(run_dir, t.model)

def task_dense(run_dir, batch_size=16):
    '''The Task path with HVDTRAIN_SPARSE_AS_DENSE_RATIO=0: the Embedding's gradient dense.'''
    os.environ["HVDTRAIN_SPARSE_AS_DENSE_RATIO"] = "0"
    try:
        task(run_dir, batch_size)
    finally:
        del os.environ["HVDTRAIN_SPARSE_AS_DENSE_RATIO"]

def main(out, names):
    import horovod.tensorflow as hvd

    hk.init()
    for name in names:
        run_dir = os.path.join(out, name)
        hvd.start_timeline(run_dir + ".timeline.json")  # rank 0 writes it
        try:
            globals()[name](run_dir)
            outcome = {"ok": True}
        except Exception as e:  # the test that asks for this scenario fails on it
            outcome = {"crash": f"{type(e).__name__}: {e}"}
        hvd.stop_timeline()
        with open(os.path.join(out, f"{name}.rank{hk.rank()}.json"), "w") as f:
            json.dump(outcome, f)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
