"""Horovod's TF2 GradientTape example, as a Horovod user writes it, on hvdtrain's stack.

    horovodrun -np 2 python examples/horovod_tf2_mnist.py --steps 24

Horovod's examples/tensorflow2/tensorflow2_mnist.py (v0.28.1) with two changes: the digits
come from the sample bundled with hvdtrain (no download), and the step count is an argument.
It imports nothing of hvdtrain: ``import horovod.tensorflow as hvd`` and ``tf.keras``, under
Keras 3 (the default) or Keras 2 (``TF_USE_LEGACY_KERAS=1``), unchanged.
"""
import argparse
import gzip
import importlib.resources

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf


def bundled_mnist():
    """hvdtrain's 5,000-digit MNIST sample: 784 pixels (0-255) and the label per line."""
    with gzip.open(importlib.resources.files("hvdtrain") / "resources" / "mnist_5k.csv.gz") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    return rows[:, :784].reshape(-1, 28, 28), rows[:, 784].astype(np.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10000, help="steps, over all ranks")
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
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
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes,
        # after the first step (the optimizer's variables exist then).
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            # An optimizer's variables: a list in Keras 3, a method in Keras 2.
            hvd.broadcast_variables(opt.variables if isinstance(opt.variables, list)
                                    else opt.variables(), root_rank=0)

        return loss_value

    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)

        if batch % 10 == 0 and hvd.rank() == 0:
            print('Step #%d\tLoss: %.6f' % (batch, loss_value))

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        print('Saved', checkpoint.save(args.checkpoint_dir + '/ckpt'))


if __name__ == '__main__':
    main()
