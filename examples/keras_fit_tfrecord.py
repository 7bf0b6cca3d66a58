"""hk.fit on your own tf.data pipeline: TFRecord shards, interleave, map, shuffle, batch.

    horovodrun -np 2 python examples/keras_fit_tfrecord.py         # two processes
    python examples/keras_fit_tfrecord.py --epochs 1               # one process

Writes the 5,000 bundled MNIST digits as TFRecord files (--files training shards of uneven
sizes, one test file) into --data-dir, then trains from them. The pipeline is the one a
single process would use, with the per-rank batch size (Horovod's convention): hvdtrain
shards it (by file here; by element for the one test file), gives every rank the same
number of steps and resumes it exactly. Exit status 75: stopped by SIGTERM after a
checkpoint; run the same command to resume. Any other error is one line, exit 1 or 2.
"""
import argparse
import os
import sys

import hvdtrain.keras as hk  # first: hvdtrain quiets TensorFlow's start-up lines

# isort: split
import numpy as np
import tensorflow as tf

from hvdtrain.compat import keras


def write_tfrecords(data_dir, files, world):
    """The bundled sample as TFRecords: ``files`` training shards of uneven sizes, one test."""
    if os.path.exists(os.path.join(data_dir, "test.tfrecord")):
        return
    (x_train, y_train), (x_test, y_test) = hk.datasets.mnist()
    weights = 2 + np.arange(files) * 5 % 3  # uneven: 2, 4, 3, 2, 4, 3, 2, ... parts
    cuts = np.cumsum(weights)[:-1] * len(x_train) // weights.sum()
    parts = np.split(np.arange(len(x_train)), cuts)
    os.makedirs(data_dir, exist_ok=True)
    for name, x, y in [(f"train-{i:02d}-of-{files:02d}", x_train[p], y_train[p])
                       for i, p in enumerate(parts)] + [("test", x_test, y_test)]:
        with tf.io.TFRecordWriter(os.path.join(data_dir, name + ".tfrecord.tmp")) as w:
            for image, label in zip(x, y):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[image.tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(label)]))})).SerializeToString())
    for name in sorted(os.listdir(data_dir)):  # the test file last: it says "all written"
        if name.endswith(".tmp"):
            os.replace(os.path.join(data_dir, name), os.path.join(data_dir, name[:-4]))


def parse(record):
    f = tf.io.parse_single_example(record, {"image": tf.io.FixedLenFeature([], tf.string),
                                            "label": tf.io.FixedLenFeature([], tf.int64)})
    image = tf.reshape(tf.io.decode_raw(f["image"], tf.uint8), (28, 28, 1))
    return tf.cast(image, tf.float32) / 255.0, f["label"]


def pipeline(pattern, batch_size, shuffle):
    # The file list in the same order on every rank (hk.files sorts; list_files would
    # shuffle it differently on each): hvdtrain gives rank r the files r, r + size, ...
    ds = tf.data.Dataset.from_tensor_slices(hk.files(pattern))
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=4,
                       num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    if shuffle:
        ds = ds.shuffle(1000, seed=0)  # seeded: a resumed run sees the same order
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--files", type=int, default=7, help="training TFRecord files")
    p.add_argument("--data-dir", default="runs/mnist_tfrecord")
    p.add_argument("--run-dir", default="runs/keras_fit_tfrecord")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: epoch ends only)")
    args = p.parse_args(argv)
    k = keras()

    # Horovod: initialize Horovod, pin one GPU (or a share of the cores) per process.
    world = hk.init()
    # Horovod: one process per host writes the files; the others wait for them.
    if world.local_rank == 0:
        write_tfrecords(args.data_dir, args.files, world)
    world.barrier()

    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((28, 28, 1)), k.layers.Flatten(),
                          k.layers.Dense(64, activation="relu"),
                          k.layers.Dense(10, activation="softmax")])
    # Horovod: scale the learning rate by the number of processes; average the gradients.
    model.compile(loss=k.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"],
                  optimizer=hk.DistributedOptimizer(k.optimizers.Adam(args.lr * hk.size())),
                  jit_compile=False)
    try:
        train = pipeline(os.path.join(args.data_dir, "train-*.tfrecord"), args.batch_size, True)
        test = pipeline(os.path.join(args.data_dir, "test.tfrecord"), 256, False)
        # Horovod: hvdtrain shards both pipelines, agrees on the steps, broadcasts rank 0's
        # state, checkpoints the position in the epoch, reports exact global metrics.
        hk.fit(model, train, epochs=args.epochs, validation_data=test, run_dir=args.run_dir,
               checkpoint_every=args.checkpoint_every)
    except hk.Error as e:  # one line; exit 75 after SIGTERM: run the same command to resume
        return hk.report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
