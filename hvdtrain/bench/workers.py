"""What each benchmark process runs: ``python -m hvdtrain.bench.workers KIND [flags]``.

    allreduce --impl hvd|mpi4py   under horovodrun --mpi/--gloo, or mpirun (mpi4py)
    memcpy                        one process: numpy copy bandwidth, the physical reference
    plain                         (a) a minimal tf.function loop, one process, no Horovod
    mwms --index I                (d) tf.distribute.MultiWorkerMirroredStrategy worker I
                                  (TF_CONFIG is set by the caller)
    fit --impl hk|hvd_keras|keras model.fit under horovodrun: hvdtrain.keras's fit, or
                                  Horovod's own horovod.tensorflow.keras wrapper and
                                  callbacks (under either Keras: scripts/patches/python/);
                                  or plain Keras in one process, no Horovod (keras)
    fit --impl pair               under horovodrun: hk.fit, each epoch followed by one of
                                  Horovod's own Keras fit of a second model in the same
                                  processes ("paired_epochs" beside "epochs")
    fit --impl mwms --index I     model.fit under MultiWorkerMirroredStrategy, worker I
    fit --input tfrecord          (hk, mwms) from the TFRecord files in --data-dir through
                                  a tf.data pipeline (interleave, map, shuffle, batch)
    tfrecords --files N           write the training set as N TFRecord files into --out

The fit and tfrecords kinds are in ``fit_workers``. Each writes one JSON object to ``--out`` (rank or worker 0 only). The training workers use
the same model (``MnistTask.build_model``), data (``load_mnist_format``), per-rank index
plans (``epoch_plan``), preprocessing, loss and accuracy as hvdtrain, so the only difference
from ``python -m hvdtrain.mnist`` is the distribution machinery.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from hvdtrain.bench import write_json
from hvdtrain.bench.fit_workers import fit, tfrecords


def iterations(nbytes: int, scale: float = 1.0) -> int:
    """Repetitions per size: about 400 MB moved, at least 5, at most 200 (same on every rank)."""
    return int(max(5, min(200, 4e8 / nbytes)) * scale)


# --- collectives -------------------------------------------------------------------------


def allreduce(args) -> None:
    """Seconds per allreduce: the best of ``--rounds`` timed rounds (the least disturbed one on
    a shared machine), after 2 warm-ups. ``--mode graph`` calls hvd.allreduce inside a
    tf.function, as a training step does; ``eager`` calls the op from Python."""
    rows = []
    if args.impl == "hvd":
        import tensorflow as tf

        from hvdtrain import distributed

        # hvd.allreduce as hvdtrain sets Horovod up: its defaults, its thread pools.
        hvd = distributed.init("horovod", notice=lambda m: None).hvd
        rank, size = hvd.rank(), hvd.size()
        barrier = lambda: hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="bench.barrier")  # noqa: E731
        controller = "mpi" if hvd.mpi_enabled() else "gloo"
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size, barrier, controller = comm.Get_rank(), comm.Get_size(), comm.Barrier, "mpi4py"
    for nbytes in args.sizes:
        n, iters = nbytes // 4, iterations(nbytes, args.scale)
        if args.impl == "hvd":
            tensor = tf.ones([n], tf.float32)
            op = lambda: hvd.allreduce(tensor, op=hvd.Sum, name=f"bench.{nbytes}")  # noqa: E731
            if args.mode == "graph":
                op = tf.function(op)
        else:
            src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
            op = lambda: comm.Allreduce(src, dst, op=MPI.SUM)  # noqa: E731
        for _ in range(2):
            op()  # warm-up: buffers, negotiation cache, tracing
        rounds = max(1, min(args.rounds, iters))
        per_round = max(1, iters // rounds)
        times = []
        for _ in range(rounds):
            barrier()
            tick = time.perf_counter()
            for _ in range(per_round):
                out = op()
            if args.impl == "hvd":
                out.numpy()
            times.append((time.perf_counter() - tick) / per_round)
        rows.append(
            {
                "bytes": nbytes,
                "iters": per_round * rounds,
                "seconds": min(times),
                "mean_seconds": sum(times) / len(times),
            }
        )
    if rank == 0:
        write_json(
            args.out,
            {
                "impl": args.impl,
                "mode": args.mode,
                "controller": controller,
                "ranks": size,
                "rows": rows,
            },
        )


def memcpy(args) -> None:
    rows = []
    for nbytes in args.sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        iters = iterations(nbytes, args.scale)
        np.copyto(dst, src)
        tick = time.perf_counter()
        for _ in range(iters):
            np.copyto(dst, src)
        rows.append(
            {"bytes": nbytes, "iters": iters, "seconds": (time.perf_counter() - tick) / iters}
        )
    write_json(args.out, {"impl": "memcpy", "ranks": 1, "rows": rows})


# --- training peers ------------------------------------------------------------------------


def _setup(args, rank: int, size: int):
    """Data, task and model exactly as hvdtrain builds them for these flags."""
    from hvdtrain.base.compat import keras
    from hvdtrain.distributed import World
    from hvdtrain.inputs.loaders import load_mnist_format
    from hvdtrain.mnist import MnistTask

    data = load_mnist_format(args.dataset, None, False, World(), notice=lambda m: None)
    task = MnistTask(model=args.model, hidden_units=args.hidden_units, download=False)
    keras().utils.set_random_seed(args.seed)
    return data, task, lambda: task.build_model(task.config())


def _train(args, rank, size, step, evaluate=None) -> dict:
    """Run ``args.epochs`` epochs of ``step(idx)`` over this rank's plans; time each epoch."""
    import tensorflow as tf

    from hvdtrain.inputs.arrays import epoch_plan, steps_per_epoch

    n = len(args.data.x_train)
    steps = steps_per_epoch(n, args.batch, size)
    epochs = []
    for epoch in range(args.epochs):
        plan = epoch_plan(n, args.batch, rank, size, args.seed, epoch)
        tick = time.perf_counter()
        for idx in tf.data.Dataset.from_tensor_slices(plan).prefetch(2):
            last = step(idx)
        float(last)  # the epoch's last step has finished
        seconds = time.perf_counter() - tick
        record = {
            "epoch": epoch + 1,
            "seconds": seconds,
            "samples_per_sec": steps * args.batch * size / seconds,
        }
        if evaluate is not None:
            record["test_accuracy"] = evaluate()
            if args.target and record["test_accuracy"] >= args.target:
                epochs.append(record)
                break
        epochs.append(record)
    return {"epochs": epochs, "steps_per_epoch": steps, "global_batch": args.batch * size}


def plain(args) -> None:
    """(a): what a user writes without Horovod: one tf.function step, loss and accuracy."""
    import tensorflow as tf

    from hvdtrain.base.compat import keras

    args.data, task, build = _setup(args, 0, 1)
    model = build()
    optimizer = keras().optimizers.SGD(learning_rate=args.lr)
    x_all, y_all = tf.constant(args.data.x_train), tf.constant(args.data.y_train)
    sums = tf.Variable(tf.zeros([3], tf.float64))

    @tf.function
    def step(idx):
        x, y = task.preprocess(tf.gather(x_all, idx), tf.gather(y_all, idx))
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            per_example = task.loss(y, pred)
            loss = tf.reduce_mean(per_example)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.equal(tf.argmax(pred, -1, output_type=tf.int32), y)
        sums.assign_add(
            tf.cast(
                tf.stack(
                    [
                        tf.reduce_sum(per_example),
                        tf.cast(tf.size(y), tf.float32),
                        tf.reduce_sum(tf.cast(correct, tf.float32)),
                    ]
                ),
                tf.float64,
            )
        )
        return loss

    write_json(args.out, {"peer": "plain", **_train(args, 0, 1, step)})


def mwms(args) -> None:
    """(d): the same model, data and global batch under MultiWorkerMirroredStrategy."""
    import tensorflow as tf

    from hvdtrain.base.compat import keras
    from hvdtrain.distributed import usable_cores

    size = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    if "TF_NUM_INTRAOP_THREADS" not in os.environ:  # the thread pools hvdtrain gives a rank
        threads = max(1, usable_cores() // size)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    args.data, task, build = _setup(args, args.index, size)
    global_batch = args.batch * size
    with strategy.scope():
        model = build()
        optimizer = keras().optimizers.SGD(learning_rate=args.lr)
    x_all, y_all = tf.constant(args.data.x_train), tf.constant(args.data.y_train)

    def replica_step(idx):
        x, y = task.preprocess(tf.gather(x_all, idx), tf.gather(y_all, idx))
        with tf.GradientTape() as tape:
            per_example = task.loss(y, model(x, training=True))
            loss = tf.reduce_sum(per_example) / global_batch  # summed over replicas: the mean
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces
        return loss

    @tf.function
    def step(idx):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(idx,)), axis=None)

    evaluate = None
    if args.target or args.test_accuracy:
        x_test = task.preprocess(tf.constant(args.data.x_test), tf.constant(args.data.y_test))

        def evaluate():
            pred = model(x_test[0], training=False)
            return float(
                tf.reduce_mean(
                    tf.cast(
                        tf.equal(tf.argmax(pred, -1, output_type=tf.int32), x_test[1]), tf.float32
                    )
                )
            )

    result = _train(args, args.index, size, step, evaluate)
    if args.index == 0:
        write_json(args.out, {"peer": "mwms", **result})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.workers")
    p.add_argument("kind", choices=("allreduce", "memcpy", "plain", "mwms", "fit", "tfrecords"))
    p.add_argument("--out", required=True)
    p.add_argument(
        "--impl",
        choices=("hvd", "mpi4py", "hk", "hvd_keras", "keras", "mwms", "pair"),
        default="hvd",
    )
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[4096])
    p.add_argument("--scale", type=float, default=1.0, help="repetitions scale (quick: < 1)")
    p.add_argument(
        "--mode",
        choices=("eager", "graph"),
        default="eager",
        help="allreduce --impl hvd: from Python, or inside a tf.function",
    )
    p.add_argument("--rounds", type=int, default=5, help="allreduce: timed rounds, best kept")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--dataset", default="fashion_mnist")
    p.add_argument("--model", default="softmax")
    p.add_argument("--hidden-units", type=int, default=256)
    p.add_argument("--batch", type=int, default=100, help="per worker")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spe", type=int, default=1, help="fit: compile(steps_per_execution=)")
    p.add_argument(
        "--input",
        choices=("arrays", "dataset", "tfrecord"),
        default="dataset",
        help="fit --impl hvd_keras: each rank's shard as arrays, or a tf.data "
        "pipeline shuffling all examples (Horovod's examples); --impl hk|mwms "
        "tfrecord: the TFRecord files in --data-dir through a tf.data pipeline",
    )
    p.add_argument("--data-dir", help="fit --input tfrecord: the files' directory")
    p.add_argument("--files", type=int, default=8, help="tfrecords: how many files")
    p.add_argument(
        "--bn", action="store_true", help="fit, mlp: BatchNormalization after the hidden layer"
    )
    p.add_argument(
        "--no-bn-sync",
        action="store_true",
        help="fit --impl hk: leave the moving "
        "statistics unsynced (only to measure what the sync costs)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="fit --impl hk: steps between checkpoints (0: epoch ends only)",
    )
    p.add_argument("--target", type=float, default=0.0, help="mwms: stop at this test accuracy")
    p.add_argument(
        "--test-accuracy",
        action="store_true",
        help="mwms, fit --impl keras: "
        "score the test set after every epoch (untimed), for every epoch",
    )
    args = p.parse_args(argv)
    {
        "allreduce": allreduce,
        "memcpy": memcpy,
        "plain": plain,
        "mwms": mwms,
        "fit": fit,
        "tfrecords": tfrecords,
    }[args.kind](args)


if __name__ == "__main__":
    main()
