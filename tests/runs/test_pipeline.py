"""Your own data: a tf.data pipeline over TFRecord shards handed to hk.fit unchanged
(examples/keras_fit_tfrecord.py): sharded by file or by element, equal steps on uneven
files, exact resume after SIGTERM and SIGKILL, and one line for each kind of bad input."""

import os
import signal
import sys

import numpy as np
import pytest

from conftest import (
    ROOT,
    checkpoints,
    finish,
    kill_when,
    launch_example,
    rank_pids,
    result,
    run,
    script_cmd,
    start,
    wait_for,
)
from docs_pages import block

EXAMPLE = "keras_fit_tfrecord.py"
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The example's files: the 4,000 training digits in 7 TFRecord files, a test file."""
    import keras_fit_tfrecord as ex

    from hvdtrain.distributed import World

    data_dir = str(tmp_path_factory.mktemp("tfrecords"))
    ex.write_tfrecords(data_dir, 7, World())
    return data_dir


def file_sizes(data_dir):
    import tensorflow as tf

    names = sorted(n for n in os.listdir(data_dir) if n.startswith("train-"))
    return [sum(1 for _ in tf.data.TFRecordDataset(os.path.join(data_dir, n))) for n in names]


def planned(sizes, batch, ranks=2):
    """(steps, examples trained per epoch) when rank r reads files r, r + ranks, ..."""
    per_rank = [sum(sizes[r::ranks]) for r in range(ranks)]
    steps = min(-(-n // batch) for n in per_rank)
    return steps, sum(min(n, steps * batch) for n in per_rank), sum(per_rank)


def fit(env, run_dir, data_dir, *args, np_=2, timeout=240):
    proc = run(
        launch_example(np_, EXAMPLE, "--data-dir", data_dir, "--run-dir", run_dir, *args),
        env,
        timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.quick
def test_sharding_by_file_and_by_element_covers_every_example_once(records):
    """In one process, the two ranks' shards as TensorFlow's rewrite makes them: disjoint,
    together every example; by file for 7 files, by element for one file."""
    import keras_fit_tfrecord as ex
    import tensorflow as tf

    from hvdtrain.inputs import sharding

    class Rank:
        def __init__(self, rank):
            self.rank, self.size = rank, 2

    def labels(pattern, policy, rank):
        ds = ex.pipeline(os.path.join(records, pattern), 64, True)
        ds = ds.map(lambda x, y: (tf.reduce_sum(tf.reshape(x, (-1, 784)), 1), y))
        mine = sharding.shard(ds, Rank(rank), policy)
        return np.concatenate([np.asarray(x) for x, _ in mine])  # pixel sums: an example's id

    sizes = file_sizes(records)
    assert len(sizes) == 7 and len(set(sizes)) > 1 and sum(sizes) == 4000
    for pattern, policy, total in (("train-*", "file", 4000), ("test.*", "data", 1000)):
        a, b = (labels(pattern, policy, r) for r in (0, 1))
        assert len(a) + len(b) == total and len(a) and len(b)
        everyone = np.sort(np.concatenate([a, b]))
        alone = np.sort(labels(pattern, "user", 0))  # the unsharded pipeline
        np.testing.assert_array_equal(everyone, alone)
    a = labels("train-*", "file", 0)
    assert len(a) == sum(sizes[0::2])  # rank 0 read files 0, 2, 4, 6
    # A new process sees a seeded shuffle's k-th iteration as this one does: the resume's
    # premise (epoch e is always the same iteration of the pipeline).
    ds = ex.pipeline(os.path.join(records, "train-*"), 64, True)
    orders = [next(iter(ds))[1].numpy() for _ in range(3)]
    assert not np.array_equal(orders[0], orders[2])
    again = ex.pipeline(os.path.join(records, "train-*"), 64, True)
    iter(again), iter(again)
    np.testing.assert_array_equal(next(iter(again))[1].numpy(), orders[2])


@pytest.mark.keras2
@pytest.mark.quick
def test_uneven_files_two_ranks_equal_steps_every_example_counted(env, tmp_path, records):
    """7 files of uneven sizes over 2 ranks: interleave + seeded shuffle + batch + prefetch,
    unchanged; no hang, identical ranks, every example trained or in the remainder."""
    run_dir = str(tmp_path / "run")
    proc = fit(env, run_dir, records, "--epochs", 2, "--batch-size", 64)
    steps, trained, total = planned(file_sizes(records), 64)
    res = result(run_dir)
    assert res["ranks_identical"] is True and res["world_size"] == 2
    assert res["sharding"] == "file" and res["global_step"] == 2 * steps
    assert res["train_examples"] == trained and res["examples_left_out"] == total - trained
    assert total == 4000 and 0 < total - trained < 64 * 8  # the longer shard's tail
    assert res["final_val_accuracy"] > 0.7, res
    for record in records_of(run_dir):  # the slowest rank's share of the epoch
        assert 0 <= record["input_wait"] < 0.5, record
    assert "input-bound" not in proc.stderr
    assert "ran out of data" not in proc.stderr  # every rank drew exactly its steps
    assert proc.stdout.count("Epoch 2/2") == 1


def records_of(run_dir):
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_input_bound_run_says_so_once(env, tmp_path, records):
    """A pipeline whose batches take 0.3 s each: metrics.jsonl's input_wait (the slowest
    rank's share of the epoch) is most of the time, and rank 0 says so once."""
    script = tmp_path / "slow.py"
    script.write_text(BAD.format(examples=os.path.join(ROOT, "examples")))
    run_dir = str(tmp_path / "run")
    proc = run(script_cmd(2, script, "slow", records, run_dir), env, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = records_of(run_dir)
    assert record["input_wait"] > 0.5, record
    said = [l for l in proc.stderr.splitlines() if "input-bound: epoch 1's steps waited" in l]
    assert len(said) == 1, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "case, steps, sharding", [("steps", 2 * 5, "file"), ("by_hand", 2 * 32, "user")]
)
def test_steps_per_epoch_and_sharding_by_hand(env, tmp_path, records, case, steps, sharding):
    """steps_per_epoch for a dataset that repeats forever; sharded=True is not sharded again
    (each rank's 2,000 of the examples by hand: 32 batches of 64, the last of 16)."""
    script = tmp_path / "fit.py"
    script.write_text(BAD.format(examples=os.path.join(ROOT, "examples")))
    run_dir = str(tmp_path / "run")
    proc = run(script_cmd(2, script, case, records, run_dir), env, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = result(run_dir)
    assert (res["global_step"], res["sharding"]) == (steps, sharding), res
    assert res["ranks_identical"] is True
    if case == "by_hand":
        assert res["train_examples"] == 4000 and res["examples_left_out"] == 0


def sigterm_rank1(cmd, env, run_dir):
    proc = start(cmd, env)
    try:
        pids = wait_for(lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(run_dir)), 120)
        ckpts = os.path.join(run_dir, "checkpoints")
        assert pids and wait_for(lambda: os.path.isdir(ckpts) and os.listdir(ckpts), 240), (
            "no checkpoint"
        )
        os.kill(pids[1], signal.SIGTERM)
    finally:
        rc, out, err = finish(proc, 120)
    assert "stopped by SIGTERM at step" in err, err[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "result.json")), "finished before SIGTERM"


# Keras 3 only: the data position a resume restores is hvdtrain's (pipeline.Batches), the
# same under either Keras. Under Keras 2 the fit path's exact resume is
# test_resume_edges' (both kinds of checkpoint), test_models' (steps_per_execution 3)
# and test_accumulate's (Horovod's aggregation).
def test_sigterm_and_sigkill_mid_epoch_resume_gives_the_uninterrupted_weights(
    env, tmp_path, records
):
    """Stopped mid-epoch by SIGTERM to rank 1; rerun, and that run SIGKILLed (all of it) once
    it has saved a later mid-epoch checkpoint; rerun: the same weights_sha256 as the
    uninterrupted run, so each resume restored the seeded shuffle's epoch order and position
    (one chain of three launches rather than two pairs)."""
    from hvdtrain.engine import checkpoint_file as C

    args = ("--data-dir", records, "--epochs", 3, "--batch-size", 32, "--checkpoint-every", 7)
    whole = str(tmp_path / "whole")
    fit(env, whole, records, *args[2:])
    reference = result(whole)
    steps, _, _ = planned(file_sizes(records), 32)
    assert reference["global_step"] == 3 * steps and steps % 7  # checkpoints inside epochs
    cut = str(tmp_path / "cut")
    cmd = launch_example(2, EXAMPLE, "--run-dir", cut, *args)
    sigterm_rank1(cmd, env, cut)
    stopped = checkpoints(cut)[0][0]
    assert C.read(checkpoints(cut)[0][1])[0]["offset"] > 0  # mid-epoch

    def mid_epoch_after_stop():
        return [(s, p) for s, p in checkpoints(cut) if s > stopped and C.read(p)[0]["offset"] > 0]

    # The rerun resumes from the SIGTERM's checkpoint.
    kill_when(cmd, env, cut, mid_epoch_after_stop, 150, "the rerun saved no mid-epoch checkpoint")
    killed, _ = mid_epoch_after_stop()[-1]  # the first one: later ones go
    for step, path in checkpoints(cut):
        if step > killed:
            os.unlink(path)
    again = run(cmd, env, 240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and f"step {killed}" in again.stderr
    r = result(cut)
    assert r["global_step"] == reference["global_step"]
    assert r["weights_sha256"] == reference["weights_sha256"]
    assert r["train_examples"] == reference["train_examples"]


# The Keras fit guide's snippet, then Your own data's tf.data snippet, in one script of two
# ranks, each after what it leaves to the reader (its names, defined here as any script
# would). Keras 3's or Keras 2's, as the pass trains with (hvdtrain.compat).
SNIPPETS = """
import sys
sys.path.insert(0, {examples!r})
import hvdtrain.keras as hk
import tensorflow as tf
from hvdtrain.compat import keras as compat_keras
from keras_fit_tfrecord import parse

keras = compat_keras()
(x_train, y_train), (x_test, y_test) = hk.datasets.mnist()
x_train, x_test = (x.reshape(-1, 784).astype("float32") / 255.0 for x in (x_train, x_test))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10, activation="softmax")])
# keras-fit.md
{fit}
# what Your own data's snippet leaves to the reader: a model on parse's images, compiled
AUTOTUNE = tf.data.AUTOTUNE
model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hk.size())),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=False)
test_ds = tf.data.TFRecordDataset("data/test.tfrecord").map(parse).batch(256)
# data.md
{data}
"""


def test_the_guides_fit_snippets_run_as_printed(env, tmp_path, records):
    """The Keras fit guide's lines that change (arrays through hk.dataset) and Your own
    data's tf.data pipeline over TFRecord files, each executed as printed on two ranks, in a
    directory whose data/ holds the example's files: each trains its 5 epochs into the run
    directory it names."""
    fit_lines = block("guides/keras-fit.md", "import hvdtrain.keras as hk\n").text
    data_lines = block("guides/data.md", "files = tf.data.Dataset.from_tensor_slices(").text
    script = tmp_path / "snippets.py"
    script.write_text(
        SNIPPETS.format(examples=os.path.join(ROOT, "examples"), fit=fit_lines, data=data_lines)
    )
    os.symlink(records, tmp_path / "data")
    proc = run(script_cmd(2, script), env, 240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit = result(tmp_path / "runs" / "fit")
    assert (fit["world_size"], fit["ranks_identical"]) == (2, True)
    assert fit["global_step"] == 5 * (4000 // (128 * 2)) and fit["final_val_accuracy"] > 0.8
    data = result(tmp_path / "runs" / "tfrecord")
    steps, trained, _ = planned(file_sizes(records), 64)
    assert (data["world_size"], data["ranks_identical"], data["sharding"]) == (2, True, "file")
    assert data["global_step"] == 5 * steps and data["train_examples"] == trained
    assert data["final_val_accuracy"] > 0.8, data


BAD = """
import os, sys, time
sys.path.insert(0, {examples!r})
import hvdtrain.keras as hk
import tensorflow as tf
from hvdtrain.compat import keras
from keras_fit_tfrecord import pipeline

case, data_dir, run_dir = sys.argv[1:4]
hk.init()
k = keras()
model = k.Sequential([k.Input((28, 28, 1)), k.layers.Flatten(),
                      k.layers.Dense(10, activation="softmax")])
model.compile(loss="sparse_categorical_crossentropy", jit_compile=False,
              optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)))
try:
    pattern = {{"nothing": "none-*.tfrecord", "empty": "test.tfrecord"}}.get(case, "train-*")
    ds = pipeline(os.path.join(data_dir, pattern), 1000 if case == "empty" else 64, True)
    if case == "shape":
        ds = ds.map(lambda x, y: (tf.reshape(x, (-1, 784)), y))
    if case == "infinite":
        ds = ds.repeat()
    if case == "slow":  # 0.3 s for each batch, after the pipeline's own prefetch
        def slow(x):
            time.sleep(0.3)
            return x
        ds = ds.map(lambda x, y: (tf.ensure_shape(tf.numpy_function(slow, [x], tf.float32),
                                                  [None, 28, 28, 1]), y))
    settings = {{}}
    if case == "steps":  # repeats forever: the steps per epoch are given
        ds, settings = ds.repeat(), dict(steps_per_epoch=5)
    if case == "by_hand":  # Horovod's examples' own sharding, said
        ds, settings = ds.unbatch().shard(hk.size(), hk.rank()).batch(64), dict(sharded=True)
    hk.fit(model, ds, epochs=2 if settings else 1, run_dir=run_dir, **settings)
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


@pytest.mark.parametrize(
    "case, status, line",
    [
        ("corrupt", 1, "train-03-of-07.tfrecord: truncated record"),
        ("nothing", 1, "none-*.tfrecord: matches no file"),
        ("empty", 1, "the training dataset: rank 1's shard is empty"),
        ("shape", 1, "the model on the training dataset's first batch raised ValueError"),
        ("infinite", 2, "hk.fit(steps_per_epoch=None): the training dataset repeats forever"),
    ],
)
def test_bad_input_is_one_line_on_every_rank_no_hang(env, tmp_path, records, case, status, line):
    import shutil

    data_dir = str(tmp_path / "data")
    shutil.copytree(records, data_dir)
    if case == "corrupt":  # rank 1's file (files 1, 3, 5), cut inside a record's data (TF
        # reads a cut inside the 12-byte header before it as the end of the file)
        path = os.path.join(data_dir, "train-03-of-07.tfrecord")
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[: len(raw) // 2 + 300])
    script = tmp_path / "bad.py"
    script.write_text(BAD.format(examples=os.path.join(ROOT, "examples")))
    proc = run(script_cmd(2, script, case, data_dir, str(tmp_path / "run")), env, 150)
    ranks = [l for l in proc.stderr.splitlines() if "<stderr>:" in l]
    said = [l for l in ranks if line in l]
    assert proc.returncode == 1 and f"Exit code: {status}" in proc.stderr, proc.stderr[-3000:]
    assert len(said) == 1, proc.stderr[-3000:]  # once, by one rank
    assert not [l for l in ranks if "Traceback" in l], proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run" / "result.json")


TASK = """
import os
import sys

import tensorflow as tf

import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.compat import keras
from hvdtrain.data import Data

sys.path.insert(0, {examples!r})
from keras_fit_tfrecord import parse


class Records(hvdtrain.Task):
    name = "records"
    defaults = dict(learning_rate=0.001, batch_size=32, epochs=2)

    def load_data(self, config, world):  # examples, unbatched: hvdtrain shards and batches
        def examples(pattern):
            files = tf.data.Dataset.from_tensor_slices(
                hk.files(os.path.join(os.environ["RECORDS"], pattern)))
            return files.interleave(tf.data.TFRecordDataset, cycle_length=4).map(parse)
        train = examples("train-*.tfrecord").shuffle(1000, seed=config.seed)
        return Data(train, None, examples("test.tfrecord"), None)

    def build_model(self, config):
        k = keras()
        return k.Sequential([k.Input((28, 28, 1)), k.layers.Flatten(), k.layers.Dense(10)])

    def build_optimizer(self, config, learning_rate):
        return keras().optimizers.Adam(learning_rate)

    def loss(self, y, pred):
        return keras().losses.sparse_categorical_crossentropy(y, pred, from_logits=True)

    def metrics(self):
        return {{"accuracy": lambda y, p: tf.cast(tf.equal(tf.argmax(p, -1), y), tf.float32)}}
"""


# Keras 3 only: the Task path's tf.data input is hvdtrain's loop, the same under either Keras;
# the Task path's resume under Keras 2 is test_resume_edges' and test_examples' (Adam's slots).
def test_task_path_pipeline_trains_evaluates_once_and_resumes_exactly(env, tmp_path, records):
    """A Task's load_data returns tf.data pipelines of examples: hvdtrain shards them by
    file, batches them per rank, agrees on the steps, scores each test example once, and a
    SIGTERM'd run resumes to the uninterrupted run's weights_sha256."""
    from conftest import HOROVODRUN

    (tmp_path / "records_task.py").write_text(TASK.format(examples=os.path.join(ROOT, "examples")))
    env = dict(env, RECORDS=records, PYTHONPATH=f"{tmp_path}:{env['PYTHONPATH']}")

    def cmd(run_dir):
        return [
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            sys.executable,
            "-m",
            "hvdtrain",
            "run",
            "records_task:Records",
            "--run-dir",
            str(run_dir),
            "--checkpoint-every",
            "7",
            "--verbose",
            "0",
        ]

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    p = run(cmd(whole), env, 240, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    reference = result(whole)
    steps, trained, total = planned(file_sizes(records), 32)
    assert reference["global_step"] == 2 * steps and reference["ranks_identical"] is True
    assert (
        reference["train_examples"] == trained
        and reference["examples_left_out"] == total - trained
        and reference["sharding"] == "file"
    )
    assert reference["test_examples"] == 1000 and reference["test_accuracy"] > 0.7, reference
    sigterm_rank1(cmd(cut), dict(env), str(cut))
    again = run(cmd(cut), env, 240, cwd=str(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    assert result(cut)["weights_sha256"] == reference["weights_sha256"]


def test_task_pipeline_with_accumulate_steps_is_one_line(env, tmp_path, records):
    """--accumulate-steps with a Task's pipeline is not offered: refused in one line naming
    the flag, before anything is written (one process)."""
    (tmp_path / "records_task.py").write_text(TASK.format(examples=os.path.join(ROOT, "examples")))
    env = dict(env, RECORDS=records, PYTHONPATH=f"{tmp_path}:{env['PYTHONPATH']}")
    p = run(
        [
            sys.executable,
            "-m",
            "hvdtrain",
            "run",
            "records_task:Records",
            "--run-dir",
            str(tmp_path / "r"),
            "--accumulate-steps",
            "2",
        ],
        env,
        180,
        cwd=str(tmp_path),
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if "accumulate" in l]
    assert len(lines) == 1 and "tf.data pipeline" in lines[0], p.stderr[-3000:]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_fit_pipeline_backward_passes_not_dividing_the_epoch_is_one_line():
    """A pipeline of 3 batches with backward_passes_per_step=2: refused with the one line the
    arrays get (it named len(train.x), which a pipeline does not have: a traceback)."""
    import tensorflow as tf

    from hvdtrain.base.errors import ConfigError
    from hvdtrain.compat import keras
    from hvdtrain.distributed import World
    from hvdtrain.distributed.optimizer import DistributedOptimizer
    from hvdtrain.fit.script import fit_config
    from hvdtrain.inputs import pipeline

    k, world = keras(), World()
    x, y = np.zeros((12, 4), np.float32), np.zeros(12, np.int64)
    train = pipeline.Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), world)
    model = k.Sequential([k.Input((4,)), k.layers.Dense(2)])
    opt = DistributedOptimizer(k.optimizers.SGD(0.1), world=world, backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    with pytest.raises(
        ConfigError,
        match=r"backward.passes.per.step=2: must divide the 3 "
        r"steps of an epoch \(12 examples",
    ):
        fit_config(model, train, 1, world)
