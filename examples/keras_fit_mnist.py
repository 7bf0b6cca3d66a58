"""Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py, ported to hvdtrain.keras.

    horovodrun -np 2 python examples/keras_fit_mnist.py            # two processes
    python examples/keras_fit_mnist.py --epochs 1                  # one process

Trains on the 5,000 bundled MNIST digits (no network); run directory: --run-dir.
Exit status 75: stopped by SIGTERM after a checkpoint; run the same command to resume.
Any other error (a busy run directory, a diverged loss, a lost rank) is one line, exit 1 or 2.
"""
import argparse
import sys

import hvdtrain.keras as hk
from hvdtrain.compat import keras


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=128, help="per rank; 0: the whole shard")
    p.add_argument("--run-dir", default="runs/keras_fit_mnist")
    p.add_argument("--model", choices=("cnn", "dense"), default="cnn")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--no-scale-lr", action="store_true", help="keep --lr at any world size")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: epoch ends only)")
    args = p.parse_args(argv)
    k = keras()

    # Horovod: initialize Horovod, pin one GPU (or a share of the cores) per process.
    hk.init()

    (x_train, y_train), (x_test, y_test) = hk.datasets.mnist()
    x_train, x_test = x_train[..., None] / 255.0, x_test[..., None] / 255.0
    # Horovod: this rank's batches in a global order that a resume can continue exactly.
    train = hk.dataset(x_train.astype("float32"), y_train, args.batch_size or None, seed=0)

    k.utils.set_random_seed(0)
    if args.model == "cnn":
        model = k.Sequential([
            k.Input((28, 28, 1)),
            k.layers.Conv2D(32, [3, 3], activation="relu"),
            k.layers.Conv2D(64, [3, 3], activation="relu"),
            k.layers.MaxPooling2D(pool_size=(2, 2)),
            k.layers.Dropout(0.25),
            k.layers.Flatten(),
            k.layers.Dense(128, activation="relu"),
            k.layers.Dropout(0.5),
            k.layers.Dense(10, activation="softmax"),
        ])
    else:
        model = k.Sequential([k.Input((28, 28, 1)), k.layers.Flatten(),
                              k.layers.Dense(10, activation="softmax")])

    # Horovod: adjust learning rate based on number of processes.
    scaled_lr = args.lr * (1 if args.no_scale_lr else hk.size())
    opt = k.optimizers.Adam(scaled_lr) if args.optimizer == "adam" else k.optimizers.SGD(scaled_lr)
    # Horovod: add Horovod DistributedOptimizer (XLA off: no XLA kernels for its ops).
    model.compile(loss=k.losses.SparseCategoricalCrossentropy(),
                  optimizer=hk.DistributedOptimizer(opt), metrics=["accuracy"],
                  jit_compile=False)

    # Horovod: broadcast, global metrics, rank-0 checkpoints and logs, SIGTERM, watchdog.
    try:
        hk.fit(model, train, epochs=args.epochs, validation_data=(x_test, y_test),
               run_dir=args.run_dir, checkpoint_every=args.checkpoint_every)
    except hk.Error as e:  # one line; exit 75 after SIGTERM: run the same command to resume
        return hk.report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
