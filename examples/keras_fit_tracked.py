"""hk.fit logging the run to experiment trackers, once per job, from rank 0.

    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 WANDB_MODE=offline \
        horovodrun -np 2 python examples/keras_fit_tracked.py --track mlflow wandb

Trains a softmax regression on the 5,000 bundled MNIST digits (no network). The trackers'
own variables say where the server is (MLFLOW_TRACKING_URI, WANDB_API_KEY, ...); the run
directory's tracking.json keeps their run ids, so the same command after a SIGTERM (exit 75)
continues the same tracker runs.
"""
import argparse
import sys

import hvdtrain.keras as hk
from hvdtrain.compat import keras


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=10, help="per rank")
    p.add_argument("--run-dir", default="runs/fit-tracked")
    p.add_argument("--track", nargs="+", default=[], metavar="TRACKER",
                   help="mlflow, wandb and/or tensorboard")
    args = p.parse_args(argv)
    k = keras()
    hk.init()
    (x_train, y_train), (x_test, y_test) = hk.datasets.mnist()
    x_train, x_test = x_train.reshape(-1, 784) / 255.0, x_test.reshape(-1, 784) / 255.0
    train = hk.dataset(x_train.astype("float32"), y_train, args.batch_size, seed=0)
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((784,)), k.layers.Dense(10, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.05 * hk.size())),
                  jit_compile=False)
    try:
        hk.fit(model, train, epochs=args.epochs, validation_data=(x_test, y_test),
               run_dir=args.run_dir, checkpoint_every=60, track=args.track)
    except hk.Error as e:  # one line; exit 75 after SIGTERM: run the same command to resume
        return hk.report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
