"""The one training loop every task uses: shard, build, wrap, train, evaluate, report.

It never names a task; see ``task.py`` for the interface and ``distributed.py`` for every
rank-dependent decision.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from hvdtrain import compat, distributed
from hvdtrain.config import Config, ConfigError
from hvdtrain.data import DataError, epoch_plan, steps_per_epoch, test_shard
from hvdtrain.report import Reporter
from hvdtrain.task import Task

EVAL_BATCH = 1000  # evaluation has no collectives inside, so its batch is free to choose


def train(task: Task, config: Config, world: Optional[distributed.World] = None) -> dict:
    """Train ``task`` under ``config`` on every rank and return the result (all ranks).

    Rank 0 prints and writes the run directory. Raises ConfigError, DataError,
    distributed.LaunchError / RankError, compat.KerasVersionError on bad input.
    """
    keras = compat.keras()
    import tensorflow as tf

    config.validate()
    world = world or distributed.init(config.backend, config.num_workers)
    out = Reporter(world, config, config.verbose)
    data = world.agree(lambda: task.load_data(config, world), catch=(DataError, OSError))

    n_train = len(data.x_train)
    # Full batch (None or 0): each worker's whole shard per step, as the linear seed does.
    batch = config.batch_size or n_train // world.size
    steps = steps_per_epoch(n_train, batch, world.size) if batch else 0
    if steps < 1:
        raise ConfigError("batch_size", batch, f"a global batch of {batch} x {world.size} "
                          f"workers needs more than the {n_train} training examples")

    keras.utils.set_random_seed(config.seed)  # rank 0's init wins anyway (broadcast below)
    model = task.build_model(config)
    learning_rate = config.learning_rate * (world.size if config.scale_lr else 1)
    optimizer = world.wrap_optimizer(
        keras.optimizers.SGD(learning_rate=learning_rate, momentum=config.momentum))
    # Create the optimizer's slots now so that one broadcast covers the whole state.
    optimizer.build(model.trainable_variables)
    world.broadcast_variables(list(model.variables) + list(optimizer.variables))

    metric_fns = task.metrics()
    sums = tf.Variable(tf.zeros(2 + len(metric_fns), tf.float64), trainable=False)
    x_all, y_all = tf.constant(data.x_train), tf.constant(data.y_train)

    def scores(y, pred):
        per_example = task.loss(y, pred)
        parts = [per_example, tf.ones_like(per_example)]
        parts += [tf.cast(fn(y, pred), per_example.dtype) for fn in metric_fns.values()]
        return per_example, tf.stack([tf.reduce_sum(tf.cast(p, tf.float64)) for p in parts])

    @tf.function
    def train_step(idx):
        x, y = task.preprocess(tf.gather(x_all, idx), tf.gather(y_all, idx))
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            per_example, step_sums = scores(y, pred)
            loss = tf.reduce_mean(per_example)
        # Horovod: the wrapped optimizer's compute_gradients averages over all ranks.
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        sums.assign_add(step_sums)

    out.start({**config.to_dict(), "world_size": world.size, "backend": world.backend})
    out.print(f"hvdtrain: {task.name} on {world.describe()}; global batch "
              f"{batch * world.size} ({batch} per worker), {steps} steps per epoch, "
              f"learning rate {learning_rate:g}; run dir {out.run_dir}")
    names = ["loss"] + list(metric_fns)
    history, started = [], time.perf_counter()
    for epoch in range(config.epochs):
        plan = epoch_plan(n_train, batch, world.rank, world.size, config.seed, epoch)
        bar = None
        if out.verbose == 1 and task.progress_bar:
            out.print(f"Epoch {epoch + 1}/{config.epochs}")
            bar = keras.utils.Progbar(steps, stateful_metrics=names + ["samples/s"])
        sums.assign(tf.zeros_like(sums))
        tick = time.perf_counter()
        for step, idx in enumerate(tf.data.Dataset.from_tensor_slices(plan).prefetch(2)):
            train_step(idx)
            if bar is not None and (step + 1) % max(1, steps // 20) == 0 and step + 1 < steps:
                local = sums.numpy()  # rank 0's running means, for the eye only
                bar.update(step + 1, [(k, local[i] / local[1] if i == 0 else local[i + 1] /
                                       local[1]) for i, k in enumerate(names)])
        totals = world.allreduce_sum(sums.numpy())  # exact global sums over every rank
        elapsed = time.perf_counter() - tick
        record = {"epoch": epoch + 1, "epochs": config.epochs,
                  "global_step": int(optimizer.iterations.numpy()),
                  "loss": float(totals[0] / totals[1]),
                  **{k: float(totals[2 + i] / totals[1]) for i, k in enumerate(metric_fns)},
                  "samples_per_sec": float(totals[1] / elapsed), "seconds": elapsed}
        history.append(record)
        out.epoch(record)
        if bar is not None:
            bar.update(steps, [(k, record[k]) for k in names] +
                       [("samples/s", record["samples_per_sec"])], finalize=True)
        else:
            out.print(task.format_epoch(record))

    result = {
        "task": task.name, "backend": world.backend, "world_size": world.size,
        "global_step": int(optimizer.iterations.numpy()), "epochs": config.epochs,
        "batch_size": batch, "global_batch_size": batch * world.size,
        "learning_rate": learning_rate, "final_loss": history[-1]["loss"],
        "train_examples": n_train, "train_seconds": time.perf_counter() - started,
        **{f"final_{k}": history[-1][k] for k in metric_fns},
        **data.info,
    }
    if data.x_test is not None:
        result.update(evaluate(model, task, data, world, scores))
    result.update(task.summarize(model))
    out.result(result)
    out.print(task.format_result(result), level=1)
    return result


def evaluate(model, task: Task, data, world, scores) -> dict:
    """Loss and metrics over the whole test set: each rank scores its part, sums combine."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def eval_step(x, y):
        x, y = task.preprocess(x, y)
        return scores(y, model(x, training=False))[1]

    idx = test_shard(len(data.x_test), world.rank, world.size)
    local = np.zeros(2 + len(task.metrics()))
    for start in range(0, len(idx), EVAL_BATCH):
        part = idx[start:start + EVAL_BATCH]
        local += eval_step(tf.constant(data.x_test[part]), tf.constant(data.y_test[part])).numpy()
    totals = world.allreduce_sum(local)
    result = {"test_examples": int(totals[1]), "test_loss": float(totals[0] / totals[1])}
    result.update({f"test_{k}": float(totals[2 + i] / totals[1])
                   for i, k in enumerate(task.metrics())})
    return result
