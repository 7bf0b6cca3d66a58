"""The fit and tfrecords kinds of ``python -m hvdtrain.bench.workers`` (which parses
the flags): ``model.fit`` under hvdtrain.keras, Horovod's own Keras wrapper, plain Keras or
MultiWorkerMirroredStrategy, from arrays or TFRecord files; and the TFRecord files
themselves. What each kind does is in ``workers``' docstring.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from hvdtrain.bench import write_json


def _fit_model(k, args):
    """The fit case's model: the seed's softmax (784 -> 10, zero-initialised, as the Task
    path's) or a 784-hidden-10 MLP, with BatchNormalization after the hidden layer (--bn)."""
    if args.model == "softmax":
        return k.Sequential(
            [
                k.Input((784,)),
                k.layers.Dense(10, kernel_initializer="zeros", bias_initializer="zeros"),
            ]
        )
    if not args.bn:
        return k.Sequential(
            [
                k.Input((784,)),
                k.layers.Dense(args.hidden_units, activation="relu"),
                k.layers.Dense(10),
            ]
        )
    return k.Sequential(
        [
            k.Input((784,)),
            k.layers.Dense(args.hidden_units),
            k.layers.BatchNormalization(),
            k.layers.ReLU(),
            k.layers.Dense(10),
        ]
    )


def _epoch_timer(k, seconds: list):
    """A Keras callback appending each epoch's seconds (its begin to its end) to ``seconds``."""

    class Timer(k.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.tick = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.tick)

    return Timer()


def _horovod_fit(k, args, model, world, steps, compiled, timer):
    """Horovod's own Keras fit, as its examples set it up: ``model`` compiled with its
    ``DistributedOptimizer``; the callbacks (its ``BroadcastGlobalVariablesCallback``, then on
    rank 0 a ``ModelCheckpoint`` of the model and its optimizer at each epoch's end, inside the
    timed epoch: before ``timer``, as hk.fit's checkpoint is inside its); this rank's shard of
    the arrays (a slice of ``steps`` batches)."""
    import tempfile

    from hvdtrain import distributed

    hvd_keras = distributed.horovod_keras()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(k.optimizers.SGD(args.lr)), **compiled)
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), timer]
    # (no MetricAverageCallback: hk.fit's rows average no epoch metrics either)
    if world.is_chief:
        suffix = ".h5" if k.__name__ == "tf_keras" else ".keras"
        saves = tempfile.TemporaryDirectory(prefix="hvd-keras-checkpoints-")
        checkpoint = k.callbacks.ModelCheckpoint(
            os.path.join(saves.name, "checkpoint-{epoch}" + suffix)
        )
        checkpoint.saves = saves  # the directory lives as long as the callback
        callbacks.insert(1, checkpoint)
    part = slice(world.rank * steps * args.batch, (world.rank + 1) * steps * args.batch)
    return callbacks, part


def _horovod_epochs(k, args, model, x, y, steps, world, compiled, seconds):
    """--impl pair: a callback that, after each of hk.fit's epochs (its own epoch-end work and
    timer done), runs one epoch of Horovod's own Keras fit of a second model in the same
    processes (the same start weights, set up as the hvd_keras variant: ``_horovod_fit``,
    each rank's shard as arrays, the faster of its two inputs), appending that epoch's seconds
    to ``seconds``. Both sides' epochs then meet the same moments of a shared machine: epoch
    i of one against epoch i of the other."""
    other = _fit_model(k, args)
    other.set_weights(model.get_weights())
    # One list for every call: the broadcast callback broadcasts once, at its first batch.
    callbacks, part = _horovod_fit(k, args, other, world, steps, compiled, _epoch_timer(k, seconds))

    class HorovodEpoch(k.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            other.fit(
                x[part], y[part], batch_size=args.batch, epochs=1, verbose=0, callbacks=callbacks
            )

    return HorovodEpoch()


def tfrecords(args) -> None:
    """The training set (--dataset) as ``--files`` TFRecord files of equal size in the
    directory ``--out``: each example a 784-byte image and an int64 label."""
    import tensorflow as tf

    from hvdtrain.distributed import World
    from hvdtrain.inputs.loaders import load_mnist_format

    data = load_mnist_format(args.dataset, None, False, World(), notice=lambda m: None)
    os.makedirs(args.out, exist_ok=True)
    images = data.x_train.reshape(len(data.x_train), -1)
    for i, part in enumerate(np.array_split(np.arange(len(images)), args.files)):
        path = os.path.join(args.out, f"train-{i:02d}-of-{args.files:02d}.tfrecord")
        with tf.io.TFRecordWriter(path + ".tmp") as w:
            for j in part:
                w.write(
                    tf.train.Example(
                        features=tf.train.Features(
                            feature={
                                "image": tf.train.Feature(
                                    bytes_list=tf.train.BytesList(value=[images[j].tobytes()])
                                ),
                                "label": tf.train.Feature(
                                    int64_list=tf.train.Int64List(value=[int(data.y_train[j])])
                                ),
                            }
                        )
                    ).SerializeToString()
                )
        os.replace(path + ".tmp", path)


def _tfrecord_pipeline(data_dir, batch, seed):
    """What a user writes for one process, as tf.data's performance guide has it: the files
    (sorted: the same list on every rank), interleaved, the records shuffled with a seed,
    batched, then parsed a batch at a time (one parse_example per batch, not per example),
    prefetched."""
    import glob

    import tensorflow as tf

    def parse(records):
        f = tf.io.parse_example(
            records,
            {
                "image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64),
            },
        )
        images = tf.reshape(tf.io.decode_raw(f["image"], tf.uint8), (-1, 784))
        return tf.cast(images, tf.float32) / 255.0, f["label"]

    ds = tf.data.Dataset.from_tensor_slices(sorted(glob.glob(os.path.join(data_dir, "*.tfrecord"))))
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.shuffle(10000, seed=seed).batch(batch)
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def fit(args) -> None:
    """model.fit, Fashion-MNIST (--dataset), SGD, ``args.batch`` per rank,
    ``compile(steps_per_execution=args.spe)``: with hvdtrain.keras (sharded order, exact
    metrics, checkpoints, stop flag, watchdog), with Horovod's wrapper and
    BroadcastGlobalVariablesCallback (both start Horovod as hvdtrain does: same thread pools
    and Horovod settings), or (--impl keras) plain Keras in one process without Horovod: what
    a user writes for one machine."""
    import tempfile

    import tensorflow as tf

    from hvdtrain import distributed
    from hvdtrain.base.compat import keras
    from hvdtrain.inputs.arrays import steps_per_epoch
    from hvdtrain.inputs.loaders import load_mnist_format

    strategy = None
    if args.impl == "mwms":  # the strategy first: before any other TensorFlow op
        size = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
        if "TF_NUM_INTRAOP_THREADS" not in os.environ:  # the thread pools hvdtrain gives a rank
            threads = max(1, distributed.usable_cores() // size)
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    k = keras()
    world = (
        distributed.World()
        if args.impl in ("keras", "mwms")
        else distributed.init("horovod", notice=lambda m: None)
    )
    from hvdtrain.engine import run as engine

    synced = {"seconds": 0.0, "calls": 0}
    if args.no_bn_sync:  # the bench's knob for the BN sync's cost: moving statistics unsynced
        engine.MovingStatistics.sync = lambda self, global_step: None
        # so the ranks' statistics differ by design: the check before each checkpoint and at
        # the end (a failure in a real run) is left out too
        engine.Run.check_agreement = lambda self: None
        agreement = engine.weights_agreement
        engine.weights_agreement = lambda world, model: {**agreement(world, model), "differ": []}
    elif args.impl == "hk":  # the sync's own time, every call (a no-op one too)
        sync = engine.MovingStatistics.sync

        def timed(self, global_step):
            tick = time.perf_counter()
            sync(self, global_step)
            synced["seconds"] += time.perf_counter() - tick
            synced["calls"] += 1

        engine.MovingStatistics.sync = timed
    # The full Fashion-MNIST (60,000 examples, 468 steps per epoch at 64 x 2): per-epoch work
    # (hvdtrain's checkpoint, metric sums, metrics line) weighs as in a real run, not as in
    # the 31 steps of the 4,000-digit sample.
    data = load_mnist_format(args.dataset, None, False, world, notice=lambda m: None)
    x = (data.x_train.reshape(-1, 784) / 255.0).astype("float32")
    y = data.y_train.astype("int64")
    k.utils.set_random_seed(args.seed)
    model = _fit_model(k, args)
    loss = k.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = steps_per_epoch(len(x), args.batch, world.size)
    times = []

    def timer():  # each epoch's seconds into times
        return _epoch_timer(k, times)

    class TestAccuracy(k.callbacks.Callback):  # after timer(): outside the timed epoch
        def on_epoch_end(self, epoch, logs=None):
            pred = self.model(
                (data.x_test.reshape(-1, 784) / 255.0).astype("float32"), training=False
            )
            times[-1] = {
                "seconds": times[-1],
                "test_accuracy": float(np.mean(np.argmax(np.asarray(pred), -1) == data.y_test)),
            }

    compiled = dict(loss=loss, metrics=["accuracy"], steps_per_execution=args.spe)
    trained = steps * args.batch * world.size  # examples per epoch
    if args.input == "tfrecord":  # every example, the last batch of each shard short
        trained = len(x)
    paired = []  # --impl pair: Horovod's fit's epochs, each right after one of hk.fit's
    if args.impl in ("hk", "pair"):
        import hvdtrain.keras as hk

        model.compile(
            optimizer=hk.DistributedOptimizer(k.optimizers.SGD(args.lr)),
            jit_compile=False,
            **compiled,
        )
        train = (
            _tfrecord_pipeline(args.data_dir, args.batch, args.seed)
            if args.input == "tfrecord"
            else hk.dataset(x, y, args.batch, seed=args.seed)
        )
        callbacks = [timer()]
        if args.impl == "pair":
            callbacks.append(_horovod_epochs(k, args, model, x, y, steps, world, compiled, paired))
        with tempfile.TemporaryDirectory() as run_dir:
            hk.fit(
                model,
                train,
                args.epochs,
                run_dir=run_dir,
                callbacks=callbacks,
                verbose=0,
                checkpoint_every=args.checkpoint_every,
            )
    elif args.impl == "mwms":  # the reference for a pipeline: Keras' own multi-worker fit,
        # the same pipeline at the global batch, auto-sharded by file (each worker reads its
        # files and batches its share of each global batch)
        world_size = strategy.num_replicas_in_sync
        with strategy.scope():
            model = _fit_model(k, args)
            model.compile(optimizer=k.optimizers.SGD(args.lr), **compiled)
        ds = _tfrecord_pipeline(args.data_dir, args.batch * world_size, args.seed)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.FILE
        )
        model.fit(ds.with_options(options), epochs=args.epochs, verbose=0, callbacks=[timer()])
    elif args.impl == "hvd_keras":  # the reference: Horovod's own path
        callbacks, part = _horovod_fit(k, args, model, world, steps, compiled, timer())
        if args.input == "arrays":  # each rank its own shard, as arrays
            model.fit(
                x[part],
                y[part],
                batch_size=args.batch,
                epochs=args.epochs,
                verbose=0,
                callbacks=callbacks,
            )
        else:  # Horovod's examples: a tf.data pipeline, shuffled with a seed per rank
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
                len(x), seed=args.seed + world.rank
            )
            model.fit(
                ds.repeat().batch(args.batch).prefetch(2),
                steps_per_epoch=steps,
                epochs=args.epochs,
                verbose=0,
                callbacks=callbacks,
            )
    else:  # one process, the arrays as a user passes them: Keras shuffles the indices and
        # gathers each batch in its input pipeline
        model.compile(optimizer=k.optimizers.SGD(args.lr), **compiled)
        model.fit(
            x[: steps * args.batch],
            y[: steps * args.batch],
            batch_size=args.batch,
            epochs=args.epochs,
            verbose=0,
            callbacks=[timer()] + ([TestAccuracy()] if args.test_accuracy else []),
        )
    epochs = []
    for i, t in enumerate(times):  # seconds, or seconds and the test accuracy after them
        e = t if isinstance(t, dict) else {"seconds": t}
        epochs.append({"epoch": i + 1, **e, "samples_per_sec": trained / e["seconds"]})
    if world.is_chief and (strategy is None or args.index == 0):
        write_json(
            args.out,
            {
                "peer": f"fit-{args.impl}",
                "keras": f"{k.__name__} {k.__version__}",
                "epochs": epochs,
                "steps_per_epoch": steps,
                "bn_sync": synced,
                "paired_epochs": [
                    {"epoch": i + 1, "seconds": t, "samples_per_sec": trained / t}
                    for i, t in enumerate(paired)
                ],
            },
        )
