"""Horovod's own TensorFlow API, used as a user's Horovod script uses it, on 2 ranks.

    horovodrun -np 2 python tests/horovod_api_probe.py OUT_DIR

Nothing of hvdtrain is imported: this is ``import horovod.tensorflow as hvd`` and
``horovod.tensorflow.keras`` with ``tf.keras`` (Keras 3 by default, Keras 2 under
TF_USE_LEGACY_KERAS=1), on the Horovod that scripts/setup.sh builds and patches. Each probe
computes what Horovod returned and, next to it, what it should be, computed here from every
rank's inputs (allgathered) without the API under test; rank 0 writes them to
OUT_DIR/probe.json and tests/runs/test_horovod_api.py asserts on the numbers. A probe that raises
records its error line instead, so that one broken API fails its own test only.
"""

import contextlib
import io
import json
import os
import sys
import traceback

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvdk
import numpy as np
import tensorflow as tf

keras = tf.keras
# Process sets: [0] given to hvd.init (static), [1] added after it (dynamic, which needs
# this variable on every rank before init).
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
ONLY_0 = hvd.ProcessSet([0])
hvd.init(process_sets=[ONLY_0])
RANK, SIZE = hvd.rank(), hvd.size()
OUT = sys.argv[1]
results = {"keras": keras.__name__, "size": SIZE}
# The GPU build's CPU ranks stall in the process-set, join, alltoall, reducescatter and Adasum
# probes (a rank left waiting alone in a collective): not checked there yet.
GPU_BUILD = hvd.nccl_built()
GPU_SKIP = {"skipped": "not checked on the GPU build's CPU ranks (they stall in it)"}


def probe(fn):
    try:
        results[fn.__name__] = fn()
    except Exception as e:  # noqa: BLE001 (recorded for the test to show; the other probes run)
        results[fn.__name__] = {
            "error": f"{type(e).__name__}: {e}".splitlines()[0],
            "traceback": traceback.format_exc(),
        }
    return fn


def gather(x):
    """Every rank's x, stacked: (SIZE, ...)."""
    x = tf.convert_to_tensor(x)
    return hvd.allgather(x[None]).numpy()


def rank_data(n=8, d=3, seed=0):
    """Each rank's own inputs, different on every rank."""
    rng = np.random.default_rng(seed + 100 * RANK)
    return rng.normal(size=(n, d)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def dense_model(seed, d=3, units=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input(shape=(d,)), keras.layers.Dense(units)])
    return model


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def local_grads(model, x, y, loss_fn=None):
    loss_fn = loss_fn or (lambda: tf.reduce_mean(tf.square(model(x) - y)))
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@probe
def gradient_tape():
    """DistributedGradientTape: each reduced gradient is the mean of the ranks' own."""
    x, y = rank_data()
    model = dense_model(1)
    own = local_grads(model, x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    reduced = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    means = [gather(g).mean(axis=0) for g in own]
    return {
        "err": max(maxdiff(r, m) for r, m in zip(reduced, means)),
        "ranks_differ": max(float(np.ptp(gather(g), axis=0).max()) for g in own),
    }


@probe
def gradient_tape_in_function():
    """DistributedGradientTape inside a tf.function training step (Horovod's TF2 example)."""
    x, y = rank_data(seed=1)
    model = dense_model(2)
    opt = keras.optimizers.SGD(0.1)
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step()
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before, own)]
    return {
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
        "ranks_equal": max(float(np.ptp(gather(a), axis=0).max()) for a in after),
    }


@probe
def partial_gradient_tape():
    """PartialDistributedGradientTape: the local layer's gradient is the rank's own / size,
    the others the mean over the ranks."""
    x, y = rank_data(seed=2)
    keras.utils.set_random_seed(3)
    local = keras.layers.Dense(2, name="local")
    model = keras.Sequential([keras.Input(shape=(3,)), local, keras.layers.Dense(1)])
    own = local_grads(model, x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    got = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    n_local = len(local.trainable_weights)
    expected = [g / SIZE for g in own[:n_local]] + [gather(g).mean(axis=0) for g in own[n_local:]]
    return {"err": max(maxdiff(a, e) for a, e in zip(got, expected)), "n_local": n_local}


@probe
def local_source():
    """register_local_source (model parallel): that variable's gradient stays the rank's own
    (scale_local_gradients=False)."""
    x, y = rank_data(seed=4)
    model = dense_model(5)
    own = local_grads(model, x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
    kernel, bias = model.trainable_variables
    tape.register_local_source(bias)
    got_kernel, got_bias = [g.numpy() for g in tape.gradient(loss, [kernel, bias])]
    return {
        "err_global": maxdiff(got_kernel, gather(own[0]).mean(axis=0)),
        "err_local": maxdiff(got_bias, own[1]),
    }


@probe
def sparse_as_dense():
    """An Embedding's gradient (IndexedSlices), sparse_as_dense=True: dense and averaged."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input(shape=(2,), dtype="int32"),
            keras.layers.Embedding(5, 2),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    ids = tf.constant([[RANK, 1], [2, RANK + 2]])
    target = tf.constant([[1.0], [-1.0]])

    def grads_of(wrap):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - target))
        if wrap:
            tape = hvd.DistributedGradientTape(tape, sparse_as_dense=True)
        return tape.gradient(loss, model.trainable_variables)

    own = [tf.convert_to_tensor(g).numpy() for g in grads_of(False)]
    reduced = grads_of(True)
    return {
        "dense": not isinstance(reduced[0], tf.IndexedSlices),
        "err": max(
            maxdiff(tf.convert_to_tensor(r).numpy(), gather(g).mean(axis=0))
            for r, g in zip(reduced, own)
        ),
    }


@probe
def broadcast_model_and_optimizer():
    """broadcast_variables of a model's and a built optimizer's variables: rank 0's values."""
    model = dense_model(10 + RANK)  # other weights on each rank
    opt = keras.optimizers.Adam(0.01)
    x, y = rank_data(seed=7)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    opt.apply_gradients(
        zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    )  # optimizer state differs per rank
    opt_vars = opt.variables() if callable(opt.variables) else opt.variables
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt_vars, root_rank=0)
    spread = [
        float(np.ptp(gather(v.numpy()), axis=0).max())
        for v in list(model.variables) + list(opt_vars)
    ]
    return {"max_spread": max(spread), "n_opt_vars": len(opt_vars)}


@probe
def allreduce_variables():
    """allreduce and grouped_allreduce of Keras variables: the mean over the ranks."""
    v = (
        keras.Variable(np.full((2, 2), RANK + 1.0, "float32"))
        if hasattr(keras, "Variable")
        else tf.Variable(np.full((2, 2), RANK + 1.0, "float32"))
    )
    model = dense_model(20 + RANK)
    kernel = model.trainable_variables[0]
    one = hvd.allreduce(v).numpy()
    group = [g.numpy() for g in hvd.grouped_allreduce([v, kernel])]
    summed = hvd.allreduce(kernel, op=hvd.Sum).numpy()
    mean_v = gather(tf.convert_to_tensor(v)).mean(axis=0)
    kernels = gather(tf.convert_to_tensor(kernel))
    return {
        "err": max(
            maxdiff(one, mean_v),
            maxdiff(group[0], mean_v),
            maxdiff(group[1], kernels.mean(axis=0)),
            maxdiff(summed, kernels.sum(axis=0)),
        ),
        "value": float(one[0, 0]),
    }


@probe
def sync_batch_norm():
    """SyncBatchNormalization in training: normalized with the global batch's statistics."""
    rng = np.random.default_rng(30 + RANK)
    x = (rng.normal(size=(6, 3)) * (RANK + 1) + RANK * 3).astype("float32")
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    out = layer(x, training=True).numpy()
    every = gather(x).reshape(-1, 3)
    mean, var = every.mean(axis=0), every.var(axis=0)
    expected = (x - mean) / np.sqrt(var + 1e-3)
    return {
        "err": maxdiff(out, expected),
        "moving_mean_err": maxdiff(layer.moving_mean.numpy(), 0.5 * mean),
        "local_differs": maxdiff(x.mean(axis=0), mean),
    }


@probe
def elastic_keras_state():
    """elastic.TensorFlowKerasState: restore brings back the committed weights exactly."""
    from horovod.tensorflow.elastic import TensorFlowKerasState, TensorFlowState

    model = dense_model(40)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=opt, loss="mse")
    x, y = rank_data(seed=8)
    model.fit(x, y, epochs=1, verbose=0)  # the optimizer is built
    state = TensorFlowKerasState(model, optimizer=opt, epoch=3)
    state.sync()
    committed = [v.numpy().copy() for v in model.variables]
    state.commit()
    model.fit(x, y, epochs=1, verbose=0)
    moved = max(maxdiff(v.numpy(), c) for v, c in zip(model.variables, committed))
    state.epoch = 9
    state.restore()
    err = max(maxdiff(v.numpy(), c) for v, c in zip(model.variables, committed))
    plain = tf.Variable([1.0, 2.0])
    vstate = TensorFlowState([plain], step=1)
    vstate.commit()
    plain.assign([5.0, 6.0])
    vstate.restore()
    return {"moved": moved, "err": err, "epoch": state.epoch, "plain": plain.numpy().tolist()}


@probe
def elastic_sync_before_the_first_step():
    """hvdk.elastic.KerasState.sync where rank 1's optimizer has not stepped yet (a worker
    that just joined) and rank 0's has (momentum slots): rank 1 ends with rank 0's weights
    and slots, the same number of them (it waited forever in the broadcasts before the
    sync-unbuilt-optimizer patch)."""
    model = dense_model(41 + RANK)  # other weights on each rank
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    if RANK == 0:
        x, y = rank_data(seed=9)
        model.fit(x, y, epochs=1, verbose=0)  # no collective: a plain optimizer, rank 0 only
    state = hvdk.elastic.KerasState(model, batch=4, epoch=2)
    state.sync()
    opt_vars = model.optimizer.variables
    opt_vars = opt_vars() if callable(opt_vars) else opt_vars
    values = [v.numpy() for v in model.variables + list(opt_vars)]
    n = gather(np.array([len(values)]))
    spread = (
        max(float(np.ptp(gather(v), axis=0).max()) for v in values) if n.min() == n.max() else None
    )
    return {
        "n_vars": n.ravel().tolist(),
        "spread": spread,
        "batch": state.batch,
        "epoch": state.epoch,
    }


def fit_data(seed):
    """Rank-dependent data for the fit probes: 2 batches of 4 per rank."""
    return rank_data(n=8, seed=seed)


@probe
def keras_distributed_optimizer():
    """hvdk.DistributedOptimizer in model.fit: one SGD step applies the mean of the ranks'
    gradients (computed here with a plain tape)."""
    x, y = fit_data(9)
    model = dense_model(50)
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before, own)]
    return {
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
        "class": type(model.optimizer).__name__,
        "module": type(model.optimizer).__module__,
    }


@probe
def keras_optimizer_apply_gradients():
    """hvdk.DistributedOptimizer in a custom loop: minimize's Keras 2 path
    (_compute_gradients) and Keras 3's apply_gradients both reduce."""
    x, y = fit_data(10)
    model = dense_model(51)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads_and_vars = opt._compute_gradients(loss, model.trainable_variables, tape=tape)
    opt.apply_gradients(grads_and_vars)
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before, own)]
    return {"err": max(maxdiff(a, e) for a, e in zip(after, expected))}


@probe
def legacy_optimizer():
    """Keras 2's keras.optimizers.legacy optimizers (Keras 3 has none): one fit step applies
    the ranks' mean gradient, and load_model(legacy_opts=True) brings one back distributed."""
    if not keras.__name__.startswith("tf_keras"):
        return {"keras3": True}
    x, y = fit_data(21)
    model = dense_model(93)
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before, own)]
    path = os.path.join(OUT, f"legacy-{RANK}.h5")
    model.save(path)
    loaded = hvdk.load_model(path, legacy_opts=True)
    return {
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
        "loaded_legacy": isinstance(loaded.optimizer, keras.optimizers.legacy.Optimizer),
        "loaded_reduces": hasattr(loaded.optimizer, "_allreduce_grads"),
    }


@probe
def backward_passes():
    """backward_passes_per_step=2: no update after the first batch; after the second, lr times
    the sum of the two batches' gradients, averaged over the ranks."""
    x, y = fit_data(11)
    model = dense_model(52)
    before = [v.numpy() for v in model.trainable_variables]
    g1 = local_grads(model, x[:4], y[:4])
    g2 = local_grads(model, x[4:], y[4:])
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2),
        loss="mse",
    )
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)
    mid = [v.numpy() for v in model.trainable_variables]
    model.fit(x[4:], y[4:], batch_size=4, epochs=1, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * (gather(a) + gather(c)).mean(axis=0) for b, a, c in zip(before, g1, g2)]
    return {
        "first_moved": max(maxdiff(m, b) for m, b in zip(mid, before)),
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
    }


@probe
def partial_distributed_optimizer():
    """hvdk.PartialDistributedOptimizer: the local layer keeps its rank's own update / size."""
    x, y = fit_data(12)
    keras.utils.set_random_seed(53)
    local = keras.layers.Dense(2)
    model = keras.Sequential([keras.Input(shape=(3,)), local, keras.layers.Dense(1)])
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)
    opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local])
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    after = [v.numpy() for v in model.trainable_variables]
    expected = [b - 0.1 * g / SIZE for b, g in zip(before[:2], own[:2])] + [
        b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before[2:], own[2:])
    ]
    return {
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
        "local_ranks_differ": float(np.ptp(gather(after[0]), axis=0).max()),
    }


@probe
def load_model():
    """hvdk.load_model: the saved optimizer's state is back, and it reduces again."""
    x, y = fit_data(13)
    model = dense_model(54)
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)), loss="mse"
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    hvd.broadcast_variables(model.variables, root_rank=0)
    path = os.path.join(
        OUT, f"model-{RANK}.keras" if keras.__name__.startswith("keras") else f"model-{RANK}.h5"
    )
    model.save(path)
    loaded = hvdk.load_model(path)
    iterations = int(loaded.optimizer.iterations.numpy())
    before = [v.numpy() for v in loaded.trainable_variables]
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = [v.numpy() for v in loaded.trainable_variables]
    plain = keras.models.load_model(path) if keras.__name__.startswith("keras") else None
    return {
        "iterations": iterations,
        "reduced": hasattr(loaded.optimizer, "_allreduce_grads"),
        "ranks_equal_after": max(float(np.ptp(gather(a), axis=0).max()) for a in after),
        "moved": max(maxdiff(a, b) for a, b in zip(after, before)),
        "loads_without_horovod": plain is not None
        and not hasattr(plain.optimizer, "_allreduce_grads"),
    }


class Record(keras.callbacks.Callback):
    """What the logs and the learning rate are at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        lr = self.model.optimizer.learning_rate
        self.epochs.append(
            {
                "logs": {k: float(v) for k, v in (logs or {}).items()},
                "lr": float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr)),
            }
        )


def rank_metric(y_true, y_pred):
    """This rank's number, whatever the batch: averaged over 2 ranks, 0.5."""
    return tf.zeros_like(tf.reduce_mean(y_pred)) + float(RANK)


@probe
def callbacks():
    """BroadcastGlobalVariablesCallback (other initial weights per rank -> equal),
    MetricAverageCallback (a metric that is the rank number -> the ranks' mean) and
    LearningRateWarmupCallback (its learning rate at each epoch's end)."""
    x, y = fit_data(14)
    model = dense_model(60 + RANK)
    initial_lr, warmup, steps = 0.02, 3, 2
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(initial_lr)),
        loss="mse",
        metrics=[rank_metric],
    )
    record = Record()
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=4,
        verbose=0,
        shuffle=False,
        callbacks=[
            hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
            hvdk.callbacks.MetricAverageCallback(),
            hvdk.callbacks.LearningRateWarmupCallback(
                initial_lr=initial_lr, warmup_epochs=warmup, steps_per_epoch=steps
            ),
            record,
        ],
    )
    expected_lr = [
        initial_lr / SIZE * ((e + 1) * (SIZE - 1) / warmup + 1) if e < warmup else initial_lr
        for e in range(4)
    ]
    return {
        "metric": [e["logs"]["rank_metric"] for e in record.epochs],
        "lr": [e["lr"] for e in record.epochs],
        "expected_lr": expected_lr,
        "logged_lr": [e["logs"].get("lr") for e in record.epochs],
        "ranks_equal": max(float(np.ptp(gather(v.numpy()), axis=0).max()) for v in model.variables),
    }


@probe
def schedule_callback():
    """LearningRateScheduleCallback (staircase, multiplier 0.5 from epoch 1): lr per epoch."""
    x, y = fit_data(15)
    model = dense_model(70)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    record = Record()
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        verbose=0,
        callbacks=[
            hvdk.callbacks.LearningRateScheduleCallback(
                initial_lr=0.1, multiplier=0.5, start_epoch=1
            ),
            record,
        ],
    )
    return {"lr": [e["lr"] for e in record.epochs]}


@probe
def best_model_checkpoint():
    """BestModelCheckpoint: the file holds the weights of the epoch with the best val_loss."""
    x, y = fit_data(16)
    model = dense_model(80)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    checkpoint = hvdk.callbacks.BestModelCheckpoint(monitor="val_loss", save_weights_only=True)
    checkpoint.filepath = os.path.join(OUT, f"best-{RANK}.weights.h5")

    class Weights(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.by_epoch = []

        def on_epoch_end(self, epoch, logs=None):
            self.by_epoch.append((logs["val_loss"], [w.copy() for w in self.model.get_weights()]))

    weights = Weights()
    # Validation on data the model does not fit: its loss goes down, then up.
    vx, vy = fit_data(17)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=6,
        verbose=0,
        validation_data=(vx, -vy),
        callbacks=[checkpoint, weights],
    )
    best = min(range(len(weights.by_epoch)), key=lambda e: weights.by_epoch[e][0])
    model.load_weights(checkpoint.filepath)
    return {
        "err": max(maxdiff(a, b) for a, b in zip(model.get_weights(), weights.by_epoch[best][1])),
        "best_epoch": best,
    }


@probe
def momentum_correction():
    """LearningRateWarmupCallback with SGD's momentum: corrected per batch under Keras 2;
    under Keras 3 (a Python number in the compiled step) one warning naming the feature, and
    the learning rate is still warmed up."""
    import warnings

    x, y = fit_data(18)
    model = dense_model(90)
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse"
    )
    record = Record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[
                hvdk.callbacks.LearningRateWarmupCallback(
                    initial_lr=0.1, warmup_epochs=2, steps_per_epoch=2
                ),
                record,
            ],
        )
    lines = [str(w.message) for w in caught if "momentum_correction" in str(w.message)]
    momentum = model.optimizer.momentum
    return {
        "warnings": lines,
        "lr": [e["lr"] for e in record.epochs],
        "momentum_after": float(
            momentum if isinstance(momentum, (int, float)) else keras.backend.get_value(momentum)
        ),
    }


@probe
def refusals():
    """What Keras 3 cannot do, each one line naming it (Keras 2: what it does instead)."""
    out = {}
    model = dense_model(91)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = fit_data(19)
    model.fit(x, y, verbose=0)
    path = os.path.join(
        OUT,
        f"refusals-{RANK}.keras" if keras.__name__.startswith("keras") else f"refusals-{RANK}.h5",
    )
    model.save(path)
    for name, call in [
        ("load_model_legacy_opts", lambda: hvdk.load_model(path, legacy_opts=True)),
        ("adasum", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)),
        (
            "accumulation_twice",
            lambda: hvdk.DistributedOptimizer(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), backward_passes_per_step=2
            ),
        ),
    ]:
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (each call's error is what is probed)
            out[name] = f"{type(e).__name__}: {e}"
    return out


@probe
def loss_scaling():
    """Keras 3, mixed_float16: DistributedOptimizer(LossScaleOptimizer(opt)) trains with the
    ranks identical, and a non-finite gradient on one rank only makes every rank skip that
    step; the compile-made order is refused in one line (Keras 2: not probed)."""
    if keras.__name__.startswith("tf_keras"):
        return {"keras2": True}
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        try:
            hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))
            refused = None
        except ValueError as e:
            refused = str(e)
        x, y = fit_data(20)
        model = dense_model(92)
        # (initial_scale 1: no overflow of its own, so the one skip below is rank 1's)
        opt = hvdk.DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0)
        )
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        steps = int(model.optimizer.iterations.numpy())
        scale = float(model.optimizer.dynamic_scale.numpy())
        before = [v.numpy() for v in model.trainable_variables]
        bad = x.copy()
        if RANK == 1:
            bad[0, 0] = np.inf  # this rank's gradient is not finite, rank 0's is
        model.fit(bad[:4], y[:4], batch_size=4, epochs=1, verbose=0)
        after = [v.numpy() for v in model.trainable_variables]
        return {
            "refused": refused,
            "compile_kept": type(model.optimizer).__name__,
            "steps": steps,
            "ranks_equal": max(float(np.ptp(gather(a), axis=0).max()) for a in after),
            "skipped_moved": max(maxdiff(a, b) for a, b in zip(after, before)),
            "scale_halved": float(model.optimizer.dynamic_scale.numpy()) / scale,
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


@probe
def broadcast_global_variables():
    """hvdk.broadcast_global_variables in eager TensorFlow 2: Horovod's one-line refusal."""
    try:
        hvdk.broadcast_global_variables(0)
    except Exception as e:  # noqa: BLE001 (Horovod's refusal is what is probed)
        return {"error": str(e).splitlines()[0]}
    return {"error": None}


@probe
def jit_compiled_fit():
    """model.compile(jit_compile=True), what Keras 3's "auto" is with a GPU visible: Horovod's
    optimizer trains, its step compiled without XLA (no XLA kernels for Horovod's ops), said
    once in one line on rank 0; the step applies the mean of the ranks' gradients."""
    x, y = fit_data(11)
    model = dense_model(51)
    before = [v.numpy() for v in model.trainable_variables]
    own = local_grads(model, x, y)
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        after = [v.numpy() for v in model.trainable_variables]
        # A second model, compiled the same way: trains, and is not told again.
        again = dense_model(52)
        again.compile(
            optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)),
            loss="mse",
            jit_compile=True,
        )
        again.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    expected = [b - 0.1 * gather(g).mean(axis=0) for b, g in zip(before, own)]
    return {
        "err": max(maxdiff(a, e) for a, e in zip(after, expected)),
        "ranks_equal": max(
            float(np.ptp(gather(v.numpy()), axis=0).max()) for v in again.trainable_variables
        ),
        "jit_compile": [model.jit_compile, again.jit_compile],
        "said": [line for line in said.getvalue().splitlines() if "jit_compile" in line],
    }


@probe
def jit_compiled_user_function():
    """A Horovod collective in the user's own tf.function(jit_compile=True), and a
    DistributedGradientTape in an XLA function nested in a plain one: each refused while
    traced, in one line naming the function, not with XLA's dump at the first call."""
    x, y = rank_data(seed=12)
    model = dense_model(53)

    @tf.function(jit_compile=True)
    def reduce_step(v):
        return hvd.allreduce(v)

    @tf.function
    def outer_step():
        @tf.function(jit_compile=True)
        def tape_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            tape = hvd.DistributedGradientTape(tape)
            return tape.gradient(loss, model.trainable_variables)

        return tape_step()

    errors = {}
    for name, call in [("reduce_step", lambda: reduce_step(tf.ones(2))), ("tape_step", outer_step)]:
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 (each call's error is what is probed)
            errors[name] = {"type": type(e).__name__, "message": str(e)}
    # The same collective in a function without XLA still runs.
    plain = tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum))(tf.ones(2) * (RANK + 1))
    return {"errors": errors, "plain_sum": plain.numpy().tolist()}


@probe
def process_sets():
    """A static set ([0], given to hvd.init) and a dynamic one ([1], added after): each
    set's allreduce is the mean over its members only, its allgather gathers its members
    only, and only its members take part (rank 0 reduces on its set twice while rank 1 does
    once on its own); removing the dynamic set leaves the global and the static one."""
    if GPU_BUILD:
        return GPU_SKIP
    only_1 = hvd.add_process_set([1])  # every rank adds it, in the same order
    own = ONLY_0 if RANK == 0 else only_1
    x = np.arange(4, dtype="float32") + 10 * RANK
    reduced = [
        hvd.allreduce(x, op=hvd.Average, process_set=own).numpy()
        for _ in range(2 if RANK == 0 else 1)
    ]
    gathered = hvd.allgather(x[None], process_set=own).numpy()
    members = [r for r in range(SIZE) if own.included() and r in own.ranks]
    expected = gather(x)[members].mean(axis=0)  # allgathered on the global set
    global_mean = hvd.allreduce(x, op=hvd.Average).numpy()
    ids = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
    same_id = gather(np.array([only_1.process_set_id]))
    hvd.remove_process_set(only_1)
    after = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
    err = gather(np.array([max(maxdiff(r, expected) for r in reduced)])).max().item()
    return {
        "err": err,
        "members": members,
        "gathered_rows": int(gathered.shape[0]),
        "gathered_err": maxdiff(gathered[0], x),
        "global_err": maxdiff(global_mean, gather(x).mean(axis=0)),
        "set_differs_from_global": maxdiff(reduced[0], global_mean),
        "ids": {str(k): v for k, v in sorted(ids.items())},
        "ids_equal": bool((same_id == same_id[0]).all()),
        "after_remove": {str(k): v for k, v in sorted(after.items())},
    }


@probe
def keras_optimizer_on_a_process_set():
    """hvdk.DistributedOptimizer(process_set=...) in fit: each rank's set is itself, so its
    step applies its own gradient (not the mean over both ranks)."""
    if GPU_BUILD:
        return GPU_SKIP
    only_1 = hvd.add_process_set([1])
    own = ONLY_0 if RANK == 0 else only_1
    x, y = fit_data(30)
    model = dense_model(30)
    before = [v.numpy() for v in model.trainable_variables]
    grads = local_grads(model, x[:4], y[:4])
    model.compile(
        optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=own), loss="mse"
    )
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0, shuffle=False)
    after = [v.numpy() for v in model.trainable_variables]
    err = max(maxdiff(a, b - 0.1 * g) for a, b, g in zip(after, before, grads))
    hvd.allreduce(tf.constant(0.0))  # both ranks done with their sets before removing one
    hvd.remove_process_set(only_1)
    return {
        "err": gather(np.array([err])).max().item(),
        "ranks_differ": max(float(np.ptp(gather(a), axis=0).max()) for a in after),
    }


@probe
def join():
    """hvd.join: rank 1 joins at once; rank 0's allreduces go on, rank 1 contributing zeros
    (the sum is rank 0's own tensor, the average that over both ranks: half of it); join
    returns the last rank to join, on every rank."""
    if GPU_BUILD:
        return GPU_SKIP
    x = np.array([1.0, -2.0, 3.5], "float32") * (RANK + 2)
    got = {}
    if RANK != 1:
        got["sum"] = hvd.allreduce(x, op=hvd.Sum).numpy().tolist()
        got["average"] = hvd.allreduce(x, op=hvd.Average).numpy().tolist()
    last = int(hvd.join())
    return dict(got, own=x.tolist(), last_joined=gather(np.array([last])).tolist())


@probe
def alltoall():
    """hvd.alltoall with splits: rank r receives, from each rank s, the rows s sends it, in
    rank order; the received splits say how many came from each."""
    if GPU_BUILD:
        return GPU_SKIP
    rows = 3 + RANK  # rank 0 sends 3 rows, rank 1 sends 4
    x = np.arange(rows * 2, dtype="float32").reshape(rows, 2) + 100 * RANK
    splits = np.array([1, 2] if RANK == 0 else [3, 1], "int32")
    received, rsplits = hvd.alltoall(x, splits=splits)
    every = hvd.allgather(x).numpy()  # all ranks' rows, rank 0's first
    every_splits = gather(splits)
    expected, start = [], 0
    for s in range(SIZE):
        offset = start + every_splits[s][:RANK].sum()
        expected.append(every[offset : offset + every_splits[s][RANK]])
        start += every_splits[s].sum()
    expected = np.concatenate(expected)
    ok = received.shape == expected.shape and maxdiff(received, expected) == 0.0
    return {
        "equal": gather(np.array([ok])).tolist(),
        "received_splits": gather(rsplits.numpy()).tolist(),
        "expected_splits": every_splits[:,].T.tolist(),
    }


@probe
def reducescatter():
    """hvd.reducescatter: rank r gets the r-th slice (along axis 0) of the ranks' sum or
    mean; grouped_reducescatter likewise for each tensor."""
    if GPU_BUILD:
        return GPU_SKIP
    x = np.arange(12, dtype="float32").reshape(4, 3) * (RANK + 1) + RANK
    every = gather(x)
    part = slice(RANK * 2, RANK * 2 + 2)
    got_sum = hvd.reducescatter(x, op=hvd.Sum).numpy()
    got_avg = hvd.reducescatter(x, op=hvd.Average).numpy()
    grouped = [g.numpy() for g in hvd.grouped_reducescatter([x, 2 * x], op=hvd.Sum)]
    err = max(
        maxdiff(got_sum, every.sum(0)[part]),
        maxdiff(got_avg, every.mean(0)[part]),
        maxdiff(grouped[0], every.sum(0)[part]),
        maxdiff(grouped[1], 2 * every.sum(0)[part]),
    )
    return {"err": gather(np.array([err])).max().item(), "shape": list(got_sum.shape)}


@probe
def adasum():
    """hvd.allreduce(op=hvd.Adasum) (the MPI controller) on 2 ranks, against its formula:
    for a, b: (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b; and for orthogonal vectors
    the sum, for equal ones the vector itself."""
    if GPU_BUILD:
        return GPU_SKIP
    rng = np.random.default_rng(7 + RANK)
    x = rng.normal(size=(5, 3)).astype("float64")
    got = hvd.allreduce(x, op=hvd.Adasum).numpy()
    a, b = (v.ravel() for v in gather(x))
    dot = a @ b
    expected = ((1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b).reshape(x.shape)
    ortho = np.array([1.0, 0.0] if RANK == 0 else [0.0, 2.0])
    same = np.array([3.0, -1.0])
    return {
        "err": gather(np.array([maxdiff(got, expected)])).max().item(),
        "differs_from_mean": maxdiff(got, gather(x).mean(0)),
        "orthogonal": hvd.allreduce(ortho, op=hvd.Adasum).numpy().tolist(),
        "equal": hvd.allreduce(same, op=hvd.Adasum).numpy().tolist(),
    }


if RANK == 0:
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(results, f, indent=1)
print(
    f"rank {RANK}: {sum(1 for v in results.values() if isinstance(v, dict) and 'error' in v and 'traceback' in v)} probes failed"
)
