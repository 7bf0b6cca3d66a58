"""A small ResNet on CIFAR-sized images (32x32x3, 10 classes) with hvdtrain.keras: the script
of the tutorial docs/tutorials/resnet-cifar.md.

    horovodrun -np 2 python examples/resnet_cifar.py --mixed-precision bfloat16
    python examples/resnet_cifar.py --epochs 1                   # one process

Trains on synthetic, learnable CIFAR-sized data made with numpy (each class a pattern of its
own, plus noise; no download), through a tf.data pipeline with random flips and crops. The
learning rate is scaled by the number of processes and warmed up to it. Run directory:
--run-dir. Exit status 75: stopped by SIGTERM or Ctrl-C after a checkpoint; run the same
command to resume. Any other error is one line, exit 1 or 2.
"""
import argparse
import sys

import hvdtrain.keras as hk  # first: hvdtrain quiets TensorFlow's start-up lines

# isort: split
import numpy as np
import tensorflow as tf

from hvdtrain.compat import keras

AUTOTUNE = tf.data.AUTOTUNE


def load_data(samples):
    """(x_train, y_train), (x_test, y_test): uint8 images of 32x32x3 and labels 0-9, as
    keras.datasets.cifar10.load_data() gives them (its labels flattened)."""
    rng = np.random.default_rng(0)  # the same data on every rank
    # Each class: a coarse colour pattern of its own, mirror-symmetric (a flip keeps its class).
    coarse = rng.normal(size=(10, 4, 4, 3))
    patterns = np.repeat(np.repeat(coarse, 8, axis=1), 8, axis=2)
    patterns = (patterns + patterns[:, :, ::-1]) / 2
    n = samples + samples // 5
    y = rng.integers(0, 10, size=n)
    x = 128 + 25 * patterns[y] + 70 * rng.normal(size=(n, 32, 32, 3))
    x = np.clip(x, 0, 255).astype("uint8")
    return (x[:samples], y[:samples]), (x[samples:], y[samples:])


def augment(seeds, image, label):
    """A random horizontal flip and a random 32x32 crop of the image padded by 4 pixels."""
    image = tf.image.stateless_random_flip_left_right(image, seeds[0])
    image = tf.pad(image, [[4, 4], [4, 4], [0, 0]], mode="REFLECT")
    return tf.image.stateless_random_crop(image, (32, 32, 3), seeds[1]), label


def pipeline(x, y, batch_size, training):
    """The pipeline one process would use, with the per-rank batch size; hvdtrain shards it."""
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.map(lambda image, label: (tf.cast(image, tf.float32) / 255.0, label))
    if training:
        ds = ds.shuffle(len(x), seed=0)  # seeded: the same order on every rank and in a resume
        # Two seeds per example for the stateless random ops: a new, fixed sequence each epoch.
        seeds = tf.data.Dataset.random(seed=1, rerandomize_each_iteration=True)
        seeds = seeds.batch(4).map(lambda s: tf.reshape(s, (2, 2)))
        ds = tf.data.Dataset.zip((seeds, ds)).map(lambda s, xy: augment(s, *xy),
                                                  num_parallel_calls=AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=training).prefetch(AUTOTUNE)


def residual_block(x, filters, strides):
    k = keras()
    shortcut = x
    x = k.layers.Conv2D(filters, 3, strides, padding="same", use_bias=False)(x)
    x = k.layers.BatchNormalization(momentum=0.9)(x)
    x = k.layers.ReLU()(x)
    x = k.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = k.layers.BatchNormalization(momentum=0.9)(x)
    if strides != 1 or shortcut.shape[-1] != filters:
        shortcut = k.layers.Conv2D(filters, 1, strides, use_bias=False)(shortcut)
        shortcut = k.layers.BatchNormalization(momentum=0.9)(shortcut)
    return k.layers.ReLU()(k.layers.Add()([x, shortcut]))


def resnet(width, blocks):
    """Three stages of `blocks` residual blocks (width, 2 x width, 4 x width filters):
    ResNet-20 with width 16 and 3 blocks."""
    k = keras()
    inputs = k.Input((32, 32, 3))
    x = k.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = k.layers.ReLU()(k.layers.BatchNormalization(momentum=0.9)(x))
    for stage in range(3):
        for block in range(blocks):
            x = residual_block(x, width * 2 ** stage, 2 if stage > 0 and block == 0 else 1)
    x = k.layers.GlobalAveragePooling2D()(x)
    # float32 probabilities under a mixed-precision policy too
    outputs = k.layers.Dense(10, activation="softmax", dtype="float32")(x)
    return k.Model(inputs, outputs)


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=10000, help="training images")
    p.add_argument("--width", type=int, default=16, help="filters of the first stage")
    p.add_argument("--blocks", type=int, default=3, help="residual blocks per stage")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=0.05, help="one process's learning rate")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--mixed-precision", choices=("float32", "bfloat16", "float16"),
                   default="float32")
    p.add_argument("--run-dir", default="runs/resnet_cifar")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: epoch ends only)")
    args = p.parse_args(argv)
    k = keras()

    hk.init()  # Horovod; one GPU (or a share of the cores) per process
    if args.mixed_precision != "float32":  # before the model is built
        k.mixed_precision.set_global_policy("mixed_" + args.mixed_precision)

    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    train = pipeline(x_train, y_train, args.batch_size, training=True)
    test = pipeline(x_test, y_test, args.batch_size, training=False)

    k.utils.set_random_seed(0)
    model = resnet(args.width, args.blocks)
    # The linear scaling rule, warmed up: from one process's rate to hk.size() times it over
    # the first epochs, then a cosine decay to 0 at the last epoch.
    steps_per_epoch = len(x_train) // (args.batch_size * hk.size())
    warmup = min(args.warmup_epochs, args.epochs - 1) * steps_per_epoch
    schedule = k.optimizers.schedules.CosineDecay(
        initial_learning_rate=args.lr, warmup_target=args.lr * hk.size(), warmup_steps=warmup,
        decay_steps=max(1, args.epochs * steps_per_epoch - warmup))
    optimizer = k.optimizers.SGD(schedule, momentum=0.9)
    model.compile(optimizer=hk.DistributedOptimizer(optimizer),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    try:
        hk.fit(model, train, epochs=args.epochs, validation_data=test, run_dir=args.run_dir,
               checkpoint_every=args.checkpoint_every)
    except hk.Error as e:  # one line; exit 75 after SIGTERM or Ctrl-C: run the same command
        return hk.report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
