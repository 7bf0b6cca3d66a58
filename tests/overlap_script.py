"""A ResNet-like model on synthetic images, trained by the Task path and then by hk.fit in one
launch: the gradient buckets' overlap test (runs/test_overlap.py) and the measurement of what
they are worth (docs/performance/speed.md).

    horovodrun -np 2 python tests/overlap_script.py RUN_DIR [--paths task,fit] [--steps 6]
        [--model small|resnet50] [--size 16] [--batch-size 16] [--epochs 1]

Rank 0 prints one JSON line: each path's samples/s of each epoch (metrics.jsonl's).
"""

import argparse
import json
import os
import sys

import numpy as np

import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.compat import keras
from hvdtrain.data import Data

CLASSES = 10


def small_resnet(size: int):
    """Three residual stages (32, 64, 128 filters), one block each: about 300,000 weights,
    the first convolutions at full resolution (the backward pass's last, longest part)."""
    k = keras()

    def block(x, filters, stride):
        y = k.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = k.layers.ReLU()(k.layers.BatchNormalization()(y))
        y = k.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = k.layers.BatchNormalization()(y)
        if stride != 1 or x.shape[-1] != filters:
            x = k.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
        return k.layers.ReLU()(k.layers.Add()([x, y]))

    inputs = k.Input((size, size, 3))
    x = k.layers.ReLU()(k.layers.Conv2D(32, 3, padding="same")(inputs))
    for filters, stride in ((32, 1), (64, 2), (128, 2)):
        x = block(x, filters, stride)
    x = k.layers.GlobalAveragePooling2D()(x)
    return k.Model(inputs, k.layers.Dense(CLASSES)(x))


def build(model: str, size: int):
    k = keras()
    k.utils.set_random_seed(0)
    if model == "resnet50":
        return k.applications.ResNet50(
            weights=None, input_shape=(size, size, 3), classes=CLASSES, classifier_activation=None
        )
    return small_resnet(size)


def images(n: int, size: int):
    rng = np.random.default_rng(0)  # the same on every rank: each trains on its shard
    return (
        rng.random((n, size, size, 3), dtype=np.float32),
        rng.integers(0, CLASSES, n).astype(np.int32),
    )


class Synthetic(hvdtrain.Task):
    name = "overlap"

    def __init__(self, args):
        super().__init__()
        self.args = args

    def load_data(self, config, world):
        x, y = images(self.args.examples, self.args.size)
        return Data(x, y, x[:CLASSES], y[:CLASSES])

    def build_model(self, config):
        return build(self.args.model, self.args.size)

    def loss(self, y, pred):
        import tensorflow as tf

        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pred)


def epochs_seen(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [round(json.loads(line)["samples_per_sec"], 1) for line in f]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--paths", default="task,fit")
    p.add_argument("--model", choices=("small", "resnet50"), default="small")
    p.add_argument("--size", type=int, default=16, help="image side")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=6, help="updates per epoch")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    world = hk.init()
    args.examples = args.steps * args.batch_size * world.size
    out = {}
    for path in args.paths.split(","):
        run_dir = os.path.join(args.run_dir, path)
        if path == "task":
            config = hvdtrain.Config(
                run_dir=run_dir,
                batch_size=args.batch_size,
                epochs=args.epochs,
                steps_per_execution=1,
                checkpoint_every=0,
                save_model=False,
                verbose=0,
            )
            hvdtrain.train(Synthetic(args), config, world)
        else:
            k = keras()
            model = build(args.model, args.size)
            model.compile(
                optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.01)),
                loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False,
            )
            x, y = images(args.examples, args.size)
            hk.fit(
                model,
                hk.dataset(x, y, args.batch_size),
                epochs=args.epochs,
                run_dir=run_dir,
                checkpoint_every=0,
                save_model=False,
                verbose=0,
            )
        out[path] = epochs_seen(run_dir)
    if world.rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
