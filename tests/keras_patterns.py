"""Users' Keras patterns, each a function of its own: tests/runs/test_keras_fit_patterns.py
copies this file as patterns.py and runs it on 2 ranks (``python patterns.py OUT NAME...``),
and imports it in one process for the references. That module's docstring lists the scenarios."""

import json
import os
import sys

import numpy as np

import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.compat import keras
from hvdtrain.data import Data

k = keras()


def dict_data():
    rng = np.random.default_rng(0)
    n = 256
    xa = rng.normal(size=(n, 4)).astype("float32")
    xb = rng.normal(size=(n, 3)).astype("float32")
    y_cls = (xa[:, 0] + xb[:, 0] > 0).astype("int64")
    y_reg = (xa[:, 1] - xb[:, 1]).astype("float32")[:, None]
    weight = rng.uniform(0.5, 1.5, size=n).astype("float32")
    return {"a": xa, "b": xb}, {"cls": y_cls, "reg": y_reg}, weight


def dicts(run_dir, batch_size=16):
    x, y, weight = dict_data()
    k.utils.set_random_seed(1)
    a, b = k.Input((4,), name="a"), k.Input((3,), name="b")
    h = k.layers.Dense(8, activation="tanh")(k.layers.Concatenate()([a, b]))
    model = k.Model(
        {"a": a, "b": b},
        {
            "cls": k.layers.Dense(2, activation="softmax", name="cls")(h),
            "reg": k.layers.Dense(1, name="reg")(h),
        },
    )
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
    )
    val = ({name: v[:40] for name, v in x.items()}, {name: v[:40] for name, v in y.items()})
    history = hk.fit(
        model,
        hk.dataset(x, y, batch_size=batch_size, seed=3, sample_weight=weight),
        epochs=2,
        validation_data=val,
        run_dir=run_dir,
        verbose=0,
    )
    return {"history": history.history}


WORDS = np.array("the cat sat on a mat and the dog ran off".split())


def text_data():
    rng = np.random.default_rng(0)
    x = rng.choice(WORDS, size=(128, 1))
    return x, (np.char.str_len(x[:, 0]) > 2).astype("int64")


def text_model(lookup):
    k.utils.set_random_seed(1)
    inp = k.Input((1,), dtype="string")
    h = k.layers.Flatten()(k.layers.Embedding(16, 4)(lookup(inp)))
    model = k.Model(inp, k.layers.Dense(2, activation="softmax")(h))
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def own_shard(x):  # what a user's per-rank data loading gives each rank
    return x[hk.rank() :: hk.size()]


def vocab_per_rank(run_dir):
    x, y = text_data()
    lookup = k.layers.StringLookup(name="words")
    lookup.adapt(own_shard(x)[:5])  # rank 1's first five words leave some out
    hk.fit(text_model(lookup), hk.dataset(x, y, batch_size=16), epochs=1, run_dir=run_dir)


def vocab_adapt(run_dir):
    x, y = text_data()
    lookup = k.layers.StringLookup(name="words")
    hk.adapt(lookup, own_shard(x)[:5])  # rank 0's five words, on every rank
    model = text_model(lookup)
    hk.fit(model, hk.dataset(x, y, batch_size=16), epochs=1, run_dir=run_dir, verbose=0)
    return {
        "vocabulary": [str(w) for w in lookup.get_vocabulary()],
        "rank0": sorted({str(w) for w in x[0 :: hk.size()][:5, 0]}),
    }


def norm_model():
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    norm = k.layers.Normalization(name="scale")
    norm.adapt(own_shard(x))  # the same shapes on every rank: no broadcast would fail
    k.utils.set_random_seed(1)
    model = k.Sequential([k.Input((3,)), norm, k.layers.Dense(2, activation="softmax")])
    return model, x, (x[:, 0] > 0).astype("int64")


def norm_per_rank(run_dir):
    model, x, y = norm_model()
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
        loss="sparse_categorical_crossentropy",
    )
    hk.fit(model, hk.dataset(x, y, batch_size=8), epochs=1, run_dir=run_dir)


class NormTask(hvdtrain.Task):
    name = "norm"

    def load_data(self, config, world):
        _, x, y = norm_model()
        return Data(x, y, x[:8], y[:8])

    def build_model(self, config):
        return norm_model()[0]

    def loss(self, y, pred):
        return k.losses.sparse_categorical_crossentropy(y, pred)


def task_norm_per_rank(run_dir):
    hvdtrain.train(
        NormTask(),
        hvdtrain.Config(run_dir=run_dir, epochs=1, batch_size=8, verbose=0),
        hvdtrain.world(),
    )


def tl_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    return x, (x[:, 0] * x[:, 1] > 0).astype("int64")


def page_transfer(run_dir):
    """The patterns page's opening script, transfer.py beside this file (the test writes it
    as the page prints it), run as a script in run_dir: its runs/tl/head and runs/tl/finetune."""
    import runpy

    os.makedirs(run_dir, exist_ok=True)  # every rank: the script's cwd
    here = os.getcwd()
    os.chdir(run_dir)
    try:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer.py")
        ns = runpy.run_path(script, run_name="__main__")
    finally:
        os.chdir(here)
    return {
        "digest": digest(ns["model"]),
        "loss": [ns["head"].history["loss"], ns["whole"].history["loss"]],
    }


def digest(model):
    import hashlib

    return hashlib.sha256(
        b"".join(np.asarray(w).tobytes() for w in model.get_weights())
    ).hexdigest()


def moved(before, after):
    return max(float(np.abs(a - b).max()) for a, b in zip(before, after))


def two_phase(run_dir, again=False):
    """Transfer learning: the head on a frozen base, then the whole model, each phase
    its own run_dir under run_dir."""
    x, y = tl_data()
    k.utils.set_random_seed(2)
    base = k.Sequential(
        [
            k.Input((8,)),
            k.layers.Dense(16, activation="relu"),
            k.layers.Dense(8, activation="relu"),
        ],
        name="base",
    )
    model = k.Sequential([base, k.layers.Dense(2, activation="softmax")])
    train = hk.dataset(x, y, batch_size=16, seed=0)
    base.trainable = False
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.Adam(1e-2)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    start = base.get_weights()
    head = hk.fit(model, train, epochs=2, run_dir=run_dir + "/head", verbose=0)
    after_head = base.get_weights()
    base.trainable = True
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.05)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    whole = hk.fit(model, train, epochs=2, run_dir=run_dir + "/finetune", verbose=0)
    out = {
        "base_moved": [moved(start, after_head), moved(after_head, base.get_weights())],
        "epochs": [head.epoch, whole.epoch],
        "loss": [head.history["loss"], whole.history["loss"]],
        "digest": digest(model),
    }
    try:  # a third phase in the second phase's run_dir: refused, it is finished
        hk.fit(model, train, epochs=2, run_dir=run_dir + "/finetune", verbose=0)
    except hk.Error as e:
        out["same_run_dir"] = [str(e), e.status]
    return out


def small(lr=0.1):
    x, y = tl_data()
    k.utils.set_random_seed(3)
    model = k.Sequential([k.Input((8,)), k.layers.Dense(2, activation="softmax")])
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(lr)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model, hk.dataset(x, y, batch_size=16, seed=0), (x[:32], y[:32])


def early(run_dir, again=False):
    """EarlyStopping ends 4 epochs after 2, restoring epoch 1's weights; the same command
    again trains nothing."""
    model, train, val = small()
    stop = k.callbacks.EarlyStopping(
        "val_loss", min_delta=10, patience=1, verbose=1, restore_best_weights=True
    )
    history = hk.fit(
        model, train, epochs=4, validation_data=val, run_dir=run_dir, callbacks=[stop], verbose=0
    )
    return {
        "epochs": history.epoch,
        "digest": digest(model),
        "step": int(model.optimizer.iterations.numpy()),
    }


def grown(run_dir, again=False):
    """1 epoch, then the same command with 2: it trains on."""
    model, train, _ = small()
    history = hk.fit(model, train, epochs=2 if again else 1, run_dir=run_dir, verbose=0)
    return {"epochs": history.epoch, "step": int(model.optimizer.iterations.numpy())}


def lr_changed(run_dir, again=False):
    """1 epoch at 0.1, then 2 at 0.01 in the same run_dir: refused as the user wrote it."""
    model, train, _ = small(0.01 if again else 0.1)
    hk.fit(model, train, epochs=2 if again else 1, run_dir=run_dir, verbose=0)


import tensorflow as tf  # noqa: E402 (after hvdtrain, which quiets TensorFlow's start-up lines)


class GAN(k.Model):
    """Keras' GAN guide's pattern on 2-D points: two optimizers, its own train_step."""

    def __init__(self, discriminator, generator, latent_dim):  # no get_config: as the
        super().__init__()  # guide's, unsaveable
        self.discriminator, self.generator = discriminator, generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = k.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss, self.g_loss = k.metrics.Mean(name="d_loss"), k.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss, self.g_loss]

    def call(self, x):
        return self.discriminator(x)

    def train_step(self, data):
        real = data[0]
        n = tf.shape(real)[0]
        fake = self.generator(tf.random.normal((n, self.latent_dim), seed=1))
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0)
        with tf.GradientTape() as tape:
            d = self.loss_fn(labels, self.discriminator(tf.concat([fake, real], 0)))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(zip(tape.gradient(d, weights), weights))
        with tf.GradientTape() as tape:
            fake = self.generator(tf.random.normal((n, self.latent_dim), seed=2))
            g = self.loss_fn(tf.zeros((n, 1)), self.discriminator(fake))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(zip(tape.gradient(g, weights), weights))
        self.d_loss.update_state(d)
        self.g_loss.update_state(g)
        return {"d_loss": self.d_loss.result(), "g_loss": self.g_loss.result()}


def gan(run_dir, distribute_d=True):
    x = (np.random.default_rng(5).normal(size=(128, 2)) + [2.0, -1.0]).astype("float32")
    k.utils.set_random_seed(4)
    model = GAN(
        k.Sequential([k.Input((2,)), k.layers.Dense(8, activation="relu"), k.layers.Dense(1)]),
        k.Sequential([k.Input((4,)), k.layers.Dense(8, activation="relu"), k.layers.Dense(2)]),
        4,
    )
    d = k.optimizers.Adam(1e-2)
    model.compile(
        d_optimizer=hk.DistributedOptimizer(d) if distribute_d else d,
        g_optimizer=hk.DistributedOptimizer(k.optimizers.Adam(1e-2)),
    )
    start = model.generator.get_weights()
    history = hk.fit(
        model, hk.dataset(x, np.zeros(len(x)), batch_size=16), epochs=2, run_dir=run_dir, verbose=0
    )
    return {
        "history": history.history,
        "digest": digest(model),
        "moved": [moved(start, model.generator.get_weights())],
        "steps": [
            int(model.d_optimizer.iterations.numpy()),
            int(model.g_optimizer.iterations.numpy()),
        ],
    }


def gan_plain_d(run_dir):
    gan(run_dir, distribute_d=False)


def embed_data():
    rng = np.random.default_rng(6)
    x = rng.integers(0, 20, size=(256, 6)).astype("int32")  # rows repeat within a batch
    return x, (x[:, 0] < 10).astype("int64")


def embed_model():
    k.utils.set_random_seed(6)
    return k.Sequential(
        [
            k.Input((6,), dtype="int32"),
            k.layers.Embedding(20, 4),
            k.layers.GlobalAveragePooling1D(),
            k.layers.Dense(2, activation="softmax"),
        ]
    )


def embed_adam(run_dir, batch_size=16):
    """Adam and an Embedding (a sparse gradient), fit path."""
    x, y = embed_data()
    model = embed_model()
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.Adam(1e-2)),
        loss="sparse_categorical_crossentropy",
    )
    hk.fit(
        model, hk.dataset(x, y, batch_size=batch_size, seed=3), epochs=2, run_dir=run_dir, verbose=0
    )
    return {"digest": digest(model)}


class EmbedTask(hvdtrain.Task):
    name = "embed"

    def load_data(self, config, world):
        x, y = embed_data()
        return Data(x, y, x[:32], y[:32])

    def build_model(self, config):
        return embed_model()

    def build_optimizer(self, config, learning_rate):
        return k.optimizers.Adam(1e-2)

    def loss(self, y, pred):
        return k.losses.sparse_categorical_crossentropy(y, pred)


def task_embed_adam(run_dir, batch_size=16):
    """Adam and an Embedding, Task path."""
    hvdtrain.train(
        EmbedTask(),
        hvdtrain.Config(run_dir=run_dir, epochs=2, batch_size=batch_size, verbose=0),
        hvdtrain.world(),
    )


class Drifting(k.Sequential):
    """A train_step that also moves a bias by hand, by its own batch's mean: each rank
    its own amount."""

    def train_step(self, data):
        logs = super().train_step(data)
        bias = self.layers[-1].bias
        bias.assign_sub(tf.ones_like(bias) * 1e-3 * tf.reduce_mean(data[0]))
        return logs


def drifting(run_dir):
    x, y = tl_data()
    k.utils.set_random_seed(3)
    model = Drifting([k.Input((8,)), k.layers.Dense(2, activation="softmax")])
    model.compile(
        optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
        loss="sparse_categorical_crossentropy",
    )
    hk.fit(model, hk.dataset(x, y, batch_size=16, seed=0), epochs=2, run_dir=run_dir, verbose=0)


def main(out, names):
    hk.init()
    again = names[0] == "again"  # the same scenarios run a second time, as a new command
    for name in names[again:]:
        run_dir = os.path.join(out, name)
        try:
            outcome = {
                "result": globals()[name](run_dir, again) if again else globals()[name](run_dir)
            }
        except hk.Error as e:
            outcome = {"error": str(e), "status": e.status, "type": type(e).__name__}
        except Exception as e:  # noqa: BLE001 (a test that asks for this scenario fails on it)
            outcome = {"crash": f"{type(e).__name__}: {e}"}
        suffix = ".again" if again else ""
        with open(os.path.join(out, f"{name}{suffix}.rank{hk.rank()}.json"), "w") as f:
            json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
