"""Horovod's TF2 Keras example, as a Horovod user writes it, on hvdtrain's stack.

    horovodrun -np 2 python examples/horovod_keras_mnist.py --epochs 4 --steps-per-epoch 8

Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (v0.28.1): hvd.DistributedOptimizer
and Horovod's callbacks (broadcast, metric averaging, learning-rate warm-up) in model.fit. The
digits come from the sample bundled with hvdtrain (no download); epochs and steps are
arguments; and two Keras 2-only things are left out so that it runs under Keras 3 (the default)
and Keras 2 (``TF_USE_LEGACY_KERAS=1``) alike: ``compile(experimental_run_tf_function=False)``
and a ``.h5`` ModelCheckpoint path (Keras 3 saves whole models as ``.keras``). It imports
nothing of hvdtrain.
"""
import argparse
import gzip
import importlib.resources

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf


def bundled_mnist():
    """hvdtrain's 5,000-digit MNIST sample: 784 pixels (0-255) and the label per line."""
    with gzip.open(importlib.resources.files("hvdtrain") / "resources" / "mnist_5k.csv.gz") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    return rows[:, :784].reshape(-1, 28, 28), rows[:, 784].astype(np.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--steps-per-epoch", type=int, default=500, help="over all ranks")
    parser.add_argument("--checkpoint-dir", default=".")
    args = parser.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    mnist_images, mnist_labels = bundled_mnist()

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
         tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000, seed=hvd.rank()).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch (before any
        # metrics-based callback).
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(args.checkpoint_dir + '/checkpoint-{epoch}.keras'))

    # Horovod: write logs on worker 0.
    verbose = 2 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(), callbacks=callbacks,
                    epochs=args.epochs, verbose=verbose)


if __name__ == '__main__':
    main()
