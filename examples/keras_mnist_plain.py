"""keras_fit_mnist.py without hvdtrain: one process, plain Keras (for comparison).

    python examples/keras_mnist_plain.py --epochs 1
"""
import argparse
import os
import sys

from hvdtrain import datasets
from hvdtrain.compat import keras


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=128, help="0: all examples")
    p.add_argument("--run-dir", default="runs/keras_mnist_plain")
    p.add_argument("--model", choices=("cnn", "dense"), default="cnn")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=0.001)
    args = p.parse_args(argv)
    k = keras()

    (x_train, y_train), (x_test, y_test) = datasets.mnist()
    x_train, x_test = x_train[..., None] / 255.0, x_test[..., None] / 255.0

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

    opt = k.optimizers.Adam(args.lr) if args.optimizer == "adam" else k.optimizers.SGD(args.lr)
    model.compile(loss=k.losses.SparseCategoricalCrossentropy(),
                  optimizer=opt, metrics=["accuracy"])

    os.makedirs(args.run_dir, exist_ok=True)
    model.fit(x_train.astype("float32"), y_train, batch_size=args.batch_size or None,
              epochs=args.epochs, validation_data=(x_test, y_test),
              callbacks=[k.callbacks.ModelCheckpoint(args.run_dir + "/checkpoint.keras")])
    model.save(args.run_dir + "/model.keras")
    return 0


if __name__ == "__main__":
    sys.exit(main())
