"""Plain Horovod training functions that tests/runs/test_ray.py hands to Horovod's
``RayExecutor`` (each runs in a Ray worker process, one per rank), and the same training in
one process on the whole batch (``reference``), which they must reproduce. Nothing of
hvdtrain: what is measured is Horovod on Ray.

A linear model, mean squared error, plain SGD: rank r trains on half r of each batch, and
the average of the two halves' gradients is the gradient of the whole batch, so two ranks
take the steps one process takes on the whole batch.
"""

import numpy as np

BATCH, FEATURES, STEPS, LR = 8, 3, 5, 0.1


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    return x, y


def initial_weights(seed):
    rng = np.random.default_rng(seed)
    return [
        rng.normal(size=(FEATURES, 1)).astype(np.float32),
        rng.normal(size=(1,)).astype(np.float32),
    ]


def model(seed):
    """The linear model with seed's weights, in the Keras this process trains with (Keras 3,
    or tf_keras under TF_USE_LEGACY_KERAS=1)."""
    import tensorflow as tf

    k = tf.keras
    m = k.Sequential([k.Input(shape=(FEATURES,)), k.layers.Dense(1)])
    m.set_weights(initial_weights(seed))
    return m


def keras_module(m):
    return type(m).__module__.split(".")[0]


def answer(hvd, m):
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "keras": keras_module(m),
        "weights": [w.tolist() for w in m.get_weights()],
    }


def gradient_tape():
    """Horovod's TF2 loop: DistributedGradientTape, the model's variables broadcast from rank
    0 (each rank starts from weights of its own: the broadcast must make them rank 0's)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    x, y = data()
    half = BATCH // hvd.size()
    x, y = (
        x[hvd.rank() * half : (hvd.rank() + 1) * half],
        y[hvd.rank() * half : (hvd.rank() + 1) * half],
    )
    m = model(seed=hvd.rank())
    hvd.broadcast_variables(m.variables, root_rank=0)
    opt = tf.keras.optimizers.SGD(LR)
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(x, training=True) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
    return answer(hvd, m)


def keras_fit():
    """Horovod's Keras path: ``model.fit`` with horovod.tensorflow.keras's
    DistributedOptimizer and BroadcastGlobalVariablesCallback, one batch per step."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init()
    x, y = data()
    half = BATCH // hvd.size()
    x, y = (
        x[hvd.rank() * half : (hvd.rank() + 1) * half],
        y[hvd.rank() * half : (hvd.rank() + 1) * half],
    )
    m = model(seed=0)
    m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR)), loss="mse")
    m.fit(
        x,
        y,
        batch_size=half,
        epochs=STEPS,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    return answer(hvd, m)


def reference(kind):
    """The same steps in one process on the whole batch, from rank 0's initial weights."""
    import tensorflow as tf

    x, y = data()
    m = model(seed=0)
    if kind == "gradient_tape":
        opt = tf.keras.optimizers.SGD(LR)
        for _ in range(STEPS):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(x, training=True) - y))
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
    else:
        m.compile(optimizer=tf.keras.optimizers.SGD(LR), loss="mse")
        m.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
    return {
        "keras": keras_module(m),
        "weights": [w.tolist() for w in m.get_weights()],
        "initial": [w.tolist() for w in initial_weights(0)],
    }


def world_sum(scale):
    """For ``hvdtrain.ray.run``: this rank's place in hvdtrain's world, and the sum over the
    ranks of (rank + 1) * scale, reduced by that world."""
    import os

    import hvdtrain

    w = hvdtrain.world()
    total = w.allreduce_sum([(w.rank + 1) * scale])
    return {"rank": w.rank, "size": w.size, "sum": float(total[0]), "pid": os.getpid()}


def fails(rank):
    """For ``hvdtrain.ray.run``: rank ``rank`` raises."""
    import hvdtrain

    if hvdtrain.world().rank == rank:
        raise ValueError(f"rank {rank} refuses")
    return "done"
