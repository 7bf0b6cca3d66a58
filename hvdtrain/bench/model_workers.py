"""What each process of the models case runs: ``python -m hvdtrain.bench.model_workers
KIND --model resnet|bert|mlp --size full|smoke --batch B --steps S --epochs E --out F``.

    one            one process, no Horovod, one thread: a ``tf.function`` step (the np-1
                   reference: a rank's share of a 2-core machine)
    tape           Horovod's GradientTape loop, as examples/tensorflow2/
                   tensorflow2_synthetic_benchmark.py (v0.28.1) writes it:
                   ``hvd.DistributedGradientTape``, variables broadcast after the first step
    hvd_fit        Horovod's Keras fit: ``horovod.tensorflow.keras.DistributedOptimizer`` and
                   ``BroadcastGlobalVariablesCallback``, Horovod's defaults (a plain
                   ``hvd.init()``: TensorFlow's own thread pools, 1 ms cycle, 128 MiB fusion)
    hvd_fit_tuned  the same, the rank started as hvdtrain starts one (thread pools of its
                   share of the cores, 0.1 ms cycle), HOROVOD_FUSION_THRESHOLD from the
                   caller, ``compile(steps_per_execution=4)``
    hk_fit         ``hvdtrain.keras``'s fit (``hk.dataset``, ``hk.fit``)
    task           hvdtrain's Task path: a Task whose ``build_model`` returns the model
    fit            plain Keras fit in one process, no Horovod, tuned as a user would tune it
                   alone (``compile(steps_per_execution=4)``, TensorFlow's own thread pools):
                   the reference of the np-1 comparison, where task and hk_fit run alone too
    mwms           ``tf.distribute.MultiWorkerMirroredStrategy`` worker ``--index`` (TF_CONFIG
                   from the caller), a custom loop as the throughput case's

Every kind trains the same model from the same seed at the same per-rank batch on synthetic
data (no downloads), SGD without momentum. The loops (one, tape, mwms) step on one fixed batch,
as Horovod's synthetic benchmark does; the fit and Task paths iterate over ``steps`` batches of
random arrays per epoch. Each writes one JSON object (rank or worker 0): per-epoch seconds and
samples/s (epoch 1 traces; the case counts epochs 2-E), the gradient bytes per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

import numpy as np

from hvdtrain.bench import write_json

# The models at each size: full (what users train) and smoke (seconds on 2 cores, the tests').
SHAPES = {
    # ResNet-50 (keras.applications, weights=None) at 32x32: 23.5 M parameters, 94 MB of
    # gradients (smoke: two residual blocks of 8 filters)
    "resnet": {"full": dict(image=32, classes=10), "smoke": dict(image=16, classes=10, width=8)},
    # BERT-small-like encoder: a 30,522-word Embedding (its gradient is sparse: IndexedSlices)
    "bert": {
        "full": dict(vocab=30522, seq=128, hidden=256, layers=4, heads=4, classes=2),
        "smoke": dict(vocab=1000, seq=16, hidden=32, layers=1, heads=2, classes=2),
    },
    # wide MLP: 1024 -> 3 x 4096 -> 10, 37.8 M parameters, 151 MB of gradients (bandwidth-bound)
    "mlp": {
        "full": dict(inputs=1024, width=4096, layers=3, classes=10),
        "smoke": dict(inputs=64, width=128, layers=2, classes=10),
    },
}


def build(k, name: str, size: str):
    """The Keras model ``name`` at ``size``, outputs logits."""
    s = SHAPES[name][size]
    if name == "resnet" and size == "full":
        return k.applications.ResNet50(
            weights=None,
            input_shape=(s["image"], s["image"], 3),
            classes=s["classes"],
            classifier_activation=None,
        )
    if name == "resnet":
        x = inputs = k.Input((s["image"], s["image"], 3))
        x = k.layers.Conv2D(s["width"], 3, padding="same", activation="relu")(x)
        for _ in range(2):  # residual blocks: conv-BN-relu-conv-BN + shortcut
            h = k.layers.Conv2D(s["width"], 3, padding="same")(x)
            h = k.layers.ReLU()(k.layers.BatchNormalization()(h))
            h = k.layers.BatchNormalization()(k.layers.Conv2D(s["width"], 3, padding="same")(h))
            x = k.layers.ReLU()(k.layers.Add()([x, h]))
        x = k.layers.GlobalAveragePooling2D()(x)
        return k.Model(inputs, k.layers.Dense(s["classes"])(x))
    if name == "bert":
        tokens = k.Input((s["seq"],), dtype="int32")
        x = k.layers.Embedding(s["vocab"], s["hidden"])(tokens)
        x = k.layers.Add()(
            [
                x,
                k.layers.Embedding(s["seq"], s["hidden"])(
                    k.layers.Lambda(lambda t: t * 0 + np.arange(s["seq"], dtype="int32"))(tokens)
                ),
            ]
        )
        for _ in range(s["layers"]):  # post-norm encoder layers, as BERT's
            a = k.layers.MultiHeadAttention(s["heads"], s["hidden"] // s["heads"])(x, x)
            x = k.layers.LayerNormalization()(k.layers.Add()([x, a]))
            f = k.layers.Dense(4 * s["hidden"], activation="gelu")(x)
            x = k.layers.LayerNormalization()(k.layers.Add()([x, k.layers.Dense(s["hidden"])(f)]))
        x = k.layers.GlobalAveragePooling1D()(x)
        return k.Model(tokens, k.layers.Dense(s["classes"])(x))
    layers = [k.Input((s["inputs"],))]
    layers += [k.layers.Dense(s["width"], activation="relu") for _ in range(s["layers"])]
    return k.Sequential(layers + [k.layers.Dense(s["classes"])])


def synthetic(name: str, size: str, n: int, seed: int):
    """``n`` random examples (x, y) for ``name``: the same on every rank for one seed."""
    s, rng = SHAPES[name][size], np.random.default_rng(seed)
    if name == "bert":
        x = rng.integers(0, s["vocab"], (n, s["seq"]), dtype=np.int32)
    elif name == "resnet":
        x = rng.random((n, s["image"], s["image"], 3), dtype=np.float32)
    else:
        x = rng.random((n, s["inputs"]), dtype=np.float32)
    return x, rng.integers(0, s["classes"], n).astype(np.int32)


def gradient_bytes(model) -> int:
    """Bytes of one step's gradients, dense: the sum of the trainable variables' sizes."""
    # a variable's dtype: its name under Keras 3, a tf.DType under tf_keras
    return int(
        sum(
            np.prod(v.shape) * np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).itemsize
            for v in model.trainable_variables
        )
    )


def _loss(k):
    return k.losses.SparseCategoricalCrossentropy(from_logits=True)


def _timer(k, seconds: list):
    """Each epoch's seconds from its first batch's start to its last batch's end: the work
    around an epoch's steps (Keras' iterator over the arrays made at its start, hk.fit's
    checkpoint at its end) is left out alike, every step counted."""

    class Timer(k.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.tick = None

        def on_train_batch_begin(self, batch, logs=None):
            if self.tick is None:
                self.tick = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(self.last - self.tick)

    return Timer()


def _loop(args, step) -> list:
    """``args.epochs`` epochs of ``args.steps`` calls of ``step``; each epoch's seconds."""
    seconds = []
    for _ in range(args.epochs):
        tick = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        float(loss)  # the epoch's last step has finished
        seconds.append(time.perf_counter() - tick)
    return seconds


def _threads(tf, threads: int) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))


def run(args) -> None:
    import tensorflow as tf

    strategy = hvd = None
    if args.kind == "one":  # one core: a rank's share of this machine (see the case)
        _threads(tf, args.threads)
    elif args.kind == "mwms":  # the strategy first: before any other TensorFlow op
        from hvdtrain.distributed import usable_cores

        workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
        _threads(tf, max(1, usable_cores() // workers))  # the pools hvdtrain gives a rank
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif args.kind in ("tape", "hvd_fit_tuned", "hk_fit", "task"):
        from hvdtrain import distributed  # started as hvdtrain starts a rank

        world = distributed.init("horovod", notice=lambda m: None)
        hvd = world.hvd if args.kind == "tape" else distributed.horovod_keras()  # both started
    elif args.kind == "fit":  # plain Keras: nothing of Horovod or hvdtrain started
        pass
    else:  # hvd_fit: Horovod's Keras example, Horovod's own defaults
        from hvdtrain import distributed

        hvd = distributed.horovod_keras()
        hvd.init()
    rank, size = (
        (hvd.rank(), hvd.size())
        if hvd is not None
        else (args.index, strategy.num_replicas_in_sync)
        if strategy
        else (0, 1)
    )
    from hvdtrain.base.compat import keras

    k = keras()
    k.utils.set_random_seed(args.seed)
    n = args.steps * args.batch * size
    x, y = synthetic(args.model, args.size, n, args.seed)
    seconds = []
    if args.kind == "task":
        seconds = _task(args, x, y)
        model = build(k, args.model, args.size)  # only for its gradient bytes
    elif args.kind in ("hk_fit", "hvd_fit", "hvd_fit_tuned", "fit"):
        model = build(k, args.model, args.size)
        _fit(args, k, model, hvd, x, y, rank, size, seconds)
    else:
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build(k, args.model, args.size)
            opt = k.optimizers.SGD(args.lr)
        xb, yb = tf.constant(x[: args.batch]), tf.constant(y[: args.batch])
        loss_fn = tf.function(_step_fn(tf, k, model, opt, xb, yb, hvd, strategy, args.batch * size))
        if strategy:
            step = tf.function(
                lambda: strategy.reduce("SUM", strategy.run(loss_fn.python_function), axis=None)
            )
        else:
            step = loss_fn
        if hvd is not None:  # Horovod: broadcast after the first step (the optimizer's
            step()  # variables exist only then), as its synthetic benchmark does
            hvd.broadcast_variables(model.variables, root_rank=0)
            variables = opt.variables  # Keras 3: a list; tf_keras: a method
            hvd.broadcast_variables(variables() if callable(variables) else variables, 0)
        seconds = _loop(args, step)
    if rank == 0:
        write_json(
            args.out,
            {
                "kind": args.kind,
                "model": args.model,
                "size": args.size,
                "ranks": size,
                "batch_per_rank": args.batch,
                "gradient_bytes": gradient_bytes(model),
                "parameters": int(model.count_params()),
                "keras": f"{k.__name__} {k.__version__}",
                "epochs": [
                    {
                        "epoch": i + 1,
                        "seconds": t,
                        "samples_per_sec": args.steps * args.batch * size / t,
                    }
                    for i, t in enumerate(seconds)
                ],
            },
        )


def _step_fn(tf, k, model, opt, xb, yb, hvd, strategy, global_batch):
    """One synchronous step on the fixed batch: Horovod's tape (tape), a replica's step
    (mwms: the loss scaled to the global batch, summed over replicas), or plain (one)."""
    loss_of = _loss(k)

    def step():
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            if strategy:
                loss = (
                    tf.reduce_sum(
                        k.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True)
                    )
                    / global_batch
                )
            else:
                loss = loss_of(yb, logits)
        if hvd is not None:  # Horovod: wrap the tape (its defaults: sparse gradients gathered)
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _fit(args, k, model, hvd, x, y, rank, size, seconds) -> None:
    tuned = args.kind in ("hvd_fit_tuned", "fit")
    compiled = dict(loss=_loss(k), steps_per_execution=4 if tuned else 1)
    timer = _timer(k, seconds)
    if args.kind == "fit":  # one process: every example, no wrapper, no callback but the timer
        model.compile(optimizer=k.optimizers.SGD(args.lr), jit_compile=False, **compiled)
        model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0, callbacks=[timer])
        return
    if args.kind == "hk_fit":
        import hvdtrain.keras as hk

        model.compile(
            optimizer=hk.DistributedOptimizer(k.optimizers.SGD(args.lr)),
            jit_compile=False,
            **compiled,
        )
        with tempfile.TemporaryDirectory() as run_dir:
            hk.fit(
                model,
                hk.dataset(x, y, args.batch, seed=args.seed),
                args.epochs,
                run_dir=run_dir,
                callbacks=[timer],
                verbose=0,
                checkpoint_every=0,
                save_model=False,
            )
        return
    # Horovod's own: its optimizer and broadcast callback, each rank its shard as arrays
    model.compile(
        optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(args.lr)), jit_compile=False, **compiled
    )
    part = slice(rank * args.steps * args.batch, (rank + 1) * args.steps * args.batch)
    model.fit(
        x[part],
        y[part],
        batch_size=args.batch,
        epochs=args.epochs,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer],
    )


def _task(args, x, y) -> list:
    """The Task path: ``hvdtrain.train`` of a Task whose ``build_model`` returns the model;
    each epoch's seconds from the run's metrics.jsonl (the epoch-end checkpoint after them)."""
    import hvdtrain
    from hvdtrain.base.compat import keras
    from hvdtrain.data import Data

    class ModelTask(hvdtrain.Task):
        name = f"bench-{args.model}"

        def load_data(self, config, world):
            return Data(x, y, None, None)

        def build_model(self, config):
            return build(keras(), args.model, args.size)

        def build_optimizer(self, config, learning_rate):
            return keras().optimizers.SGD(learning_rate)

        def loss(self, y_, pred):
            return keras().losses.sparse_categorical_crossentropy(y_, pred, from_logits=True)

    with tempfile.TemporaryDirectory() as run_dir:
        task = ModelTask()
        hvdtrain.train(
            task,
            task.config(
                batch_size=args.batch,
                epochs=args.epochs,
                learning_rate=args.lr,
                momentum=0.0,
                checkpoint_every=0,
                run_dir=run_dir,
                save_model=False,
                verbose=0,
                seed=args.seed,
                steps_per_execution=args.steps_per_execution,
            ),
        )
        metrics = os.path.join(run_dir, "metrics.jsonl")  # rank 0's run directory
        if not os.path.exists(metrics):
            return []
        with open(metrics) as f:
            return [json.loads(line)["seconds"] for line in f if line.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.model_workers")
    p.add_argument(
        "kind", choices=("one", "tape", "hvd_fit", "hvd_fit_tuned", "hk_fit", "task", "mwms", "fit")
    )
    p.add_argument("--model", choices=tuple(SHAPES), required=True)
    p.add_argument("--size", choices=("full", "smoke"), default="full")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=6, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=3, help="epoch 1 traces and warms up")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="one: TensorFlow's intra-op threads")
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=0,
        help="task: its setting (0: auto, the default)",
    )
    p.add_argument("--index", type=int, default=0, help="mwms: this worker's index")
    p.add_argument("--target", type=float, default=0.0, help="(the mwms launcher's; unused)")
    args = p.parse_args(argv)
    run(args)


if __name__ == "__main__":
    main()
