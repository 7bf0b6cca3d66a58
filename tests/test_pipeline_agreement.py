"""A tf.data pipeline whose files or order differ between the ranks, or change under a running
job: the ranks' agreement before step 0, the look at the files before each epoch and
checkpoint, a shard that runs short mid-epoch; in one process (the agreement's logic on
lists as the ranks' allgather gives them; a 2-rank view where every rank sees the same)."""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))


class Twin:
    """Rank 0 of 2 ranks that see exactly what this process sees (allgather: two copies)."""

    rank, size, is_chief = 0, 2, True

    def allgather_object(self, obj):
        return [obj, obj]

    def agree(self, fn, catch=(Exception,), merge=None):
        return fn()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """4 small TFRecord files of 40 examples each: (x, id) with id = the example's number."""
    import tensorflow as tf

    data_dir = tmp_path_factory.mktemp("records")
    for f in range(4):
        with tf.io.TFRecordWriter(str(data_dir / f"part-{f}.tfrecord")) as w:
            for i in range(40 * f, 40 * f + 40):
                w.write(tf.io.serialize_tensor(tf.constant(i, tf.int64)).numpy())
    return data_dir


def parse(record):
    import tensorflow as tf

    i = tf.io.parse_tensor(record, tf.int64)
    return tf.cast(tf.reshape(i, [1]), tf.float32), i


def examples(files):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices([str(f) for f in files]).interleave(
        tf.data.TFRecordDataset, cycle_length=2).map(parse)


@pytest.mark.quick
def test_agreement_lines_name_the_rank_and_what_differs():
    from hvdtrain import pipeline

    a = [("/d/part-0", 100), ("/d/part-1", 90), ("/d/part-2", 80)]
    same = pipeline.files_differ("the training dataset", [a, list(a)])
    assert same is None
    assert pipeline.files_differ("the training dataset", [a, a[:2]]) == (
        "the training dataset: the ranks read different files: rank 1 lacks /d/part-2 (3 "
        "files on rank 0, 2 on rank 1); every rank must list the same files (or shard them "
        "by hand: sharded=True)")
    assert "rank 1 lists them in another order (file 0: /d/part-1 where rank 0 has " \
           "/d/part-0)" in pipeline.files_differ("x", [a, [a[1], a[0], a[2]]])
    assert "/d/part-1 is 90 bytes on rank 0, 45 on rank 1" in pipeline.files_differ(
        "x", [a, [a[0], ("/d/part-1", 45), a[2]]])
    assert pipeline.order_differs("x", ["ab", "ab", "ab"]) is None
    assert pipeline.order_differs("x", ["ab", "ab", "cd"]).startswith(
        "x: rank 2 reads its batches in another order than rank 0")
    assert pipeline.batch_sizes_differ("x", [32, 32], "user") is None
    assert pipeline.batch_sizes_differ("x", [32, 16], "user") == (
        "x: rank 1's batches hold 16 examples, rank 0's 32: every rank's batches must be the "
        "per-rank batch size (batch every rank's shard alike)")
    # The run-defining description: names (not the directory) and sizes.
    moved = [("/e/part-0", 100), ("/e/part-1", 90), ("/e/part-2", 80)]
    assert pipeline.describe_files(a) == pipeline.describe_files(moved)
    assert pipeline.describe_files(a).startswith("3 files, 270 bytes, sha256 ")
    assert pipeline.describe_files(a) != pipeline.describe_files(a + [("/d/part-3", 1)])
    assert pipeline.describe_files([]) == "none"


@pytest.mark.quick
def test_by_batch_order_digest_catches_a_shuffle_seeded_by_rank(records):
    """Sharded by batch, every rank counts the whole pipeline and digests its batches: the
    same seed on every rank gives the same digest, another seed (seed=rank) another; the
    rank's own sizes from the whole count are those of its shard."""
    import tensorflow as tf

    from hvdtrain import pipeline

    def sharded(seed, batch=None):
        ds = examples(sorted(records.glob("part-*")))
        ds = ds.shuffle(160, seed=seed)
        return pipeline._sharded_sizes(ds if batch else ds.batch(16), Twin(), False, "x",
                                       batch=batch)

    ds0, sizes, policy, digest = sharded(0)
    assert (policy, sizes) == ("file", [16] * 5) and digest is None  # by file: no digest

    class Rank1(Twin):
        rank = 1

    whole = tf.data.Dataset.range(50).map(lambda i: (tf.cast([i], tf.float32), i))
    digests = []
    for seed in (0, 0, 1):
        ds = whole.shuffle(50, seed=seed).batch(8)
        _, sizes, policy, d = pipeline._sharded_sizes(ds, Twin(), False, "x")
        assert (policy, sizes) == ("data", [8, 8, 8, 2])  # batches 0, 2, 4, 6 of 7
        digests.append(d)
    assert digests[0] == digests[1] != digests[2]
    # Examples, batched per rank after sharding (the Task path): rank 1's sizes from the
    # whole count equal its shard's own.
    for rank in (Twin(), Rank1()):
        mine, sizes, _, _ = pipeline._sharded_sizes(whole, rank, False, "x", batch=8)
        assert sizes == [int(tf.shape(x)[0]) for x, _ in mine] == [8, 8, 8, 1]


@pytest.mark.quick
def test_enumerate_over_files_is_sharded_by_batch(records):
    """A TFRecord pipeline with .enumerate(): TensorFlow's file rewrite cannot shard its
    range source (a 57-line protobuf dump); sharded by batch instead, every example once."""
    from hvdtrain import pipeline

    class Rank1(Twin):
        rank = 1

    ids = []
    for rank in (Twin(), Rank1()):
        ds = examples(sorted(records.glob("part-*"))).enumerate().map(
            lambda k, xy: (xy[0], xy[1])).batch(10)
        train = pipeline.Batches(ds, rank)
        assert train.policy == "data" and train.steps == 8
        ids.append(np.concatenate([y.numpy() for _, y in train.ds]))
    assert sorted(np.concatenate(ids).tolist()) == list(range(160))


def test_input_changed_under_the_run_is_one_line(records, tmp_path):
    """A file cut short, rewritten or deleted after the start: the look before an epoch
    names it; a shard that runs short inside an epoch raises at the epoch's end instead of
    taking the next epoch's batches, said in one line naming the file."""
    import shutil

    import tensorflow as tf

    from hvdtrain import pipeline
    from hvdtrain.distributed import World
    from hvdtrain.errors import DataError, InputError

    data = tmp_path / "data"
    shutil.copytree(records, data)
    files = sorted(data.glob("part-*"))
    train = pipeline.Batches(examples(files).batch(16), World())
    assert (train.steps, train.policy, train.examples) == (10, "none", 160)
    assert train.identity()["train_files"].startswith("4 files, ")
    train.check_unchanged("before epoch 1")  # nothing changed
    stream = iter(train.batches(0, 2))
    for _ in range(10):
        next(stream)
    size = os.path.getsize(files[3])
    raw = open(files[3], "rb").read()
    open(files[3], "wb").write(raw[:size // 2 - (size // 2) % (size // 40)])  # whole records
    with pytest.raises(InputError) as e:
        train.check_unchanged("before epoch 2")
    assert str(e.value).startswith(f"{files[3]}: cut short under the running job ({size:,} -> ")
    assert " bytes) before epoch 2: training stopped, nothing saved after it; " in str(e.value)
    with pytest.raises(tf.errors.FailedPreconditionError) as short:
        for _ in range(10):
            next(stream)  # epoch 2: 9 batches, then the end instead of epoch 3's first
    line = str(train.failure(short.value, 1))
    assert line.startswith(f"{files[3]}: cut short under the running job") and \
        "in epoch 2 (rank 0): training stopped" in line
    train.snapshot = pipeline._stat(train.snapshot)  # as if it had been so from the start
    assert str(train.failure(short.value, 1)).startswith(
        "the training dataset: rank 0's shard ended after 9 of its 10 batches in epoch 2 "
        "(rank 0): its input changed under the running job")
    os.remove(files[1])
    assert train.changed() == f"{files[1]}: deleted under the running job"
    with pytest.raises(DataError, match="deleted under the running job before epoch 3"):
        train.check_unchanged("before epoch 3")


# --- real 2-rank launches --------------------------------------------------------------------

FIT = """
import os, shutil, sys
sys.path.insert(0, {examples!r})
import hvdtrain.keras as hk
import tensorflow as tf
from hvdtrain.compat import keras
from keras_fit_tfrecord import parse

case, data_dir, run_dir, epochs = sys.argv[1:5]
hk.init()
k = keras()
CUT = os.path.join(data_dir, "train-03-of-07.tfrecord")  # rank 1's (files 1, 3, 5)
size = os.path.getsize(CUT)


class Cut(k.callbacks.Callback):  # every rank (the same cut twice)
    def on_epoch_end(self, epoch, logs=None):  # after epoch 1's end
        if epoch == 0 and case == "cut":
            os.truncate(CUT, size // 2)
        if epoch == 0 and case == "delete" and os.path.exists(CUT):
            try:
                os.remove(CUT)
            except FileNotFoundError:  # the other rank was first
                pass

    def on_epoch_begin(self, epoch, logs=None):  # after hk.fit's look before epoch 2
        if epoch == 1 and case == "cut_inside":  # whole records kept
            os.truncate(CUT, size // 4 - size // 4 % 838)


def fit(case, run_dir, data_dir=data_dir):
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((28, 28, 1)), k.layers.Flatten(),
                          k.layers.Dense(10, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", jit_compile=False,
                  optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)))
    files = hk.files(os.path.join(data_dir, "train-*.tfrecord"))
    if case == "fewer_files" and hk.rank() == 1:  # by file it read 01, 03, 06: 06 twice
        files = files[:5] + files[6:]
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset,
                                                             cycle_length=4).map(parse)
    settings = {{}}
    if case == "seed_by_rank":  # one file: sharded by batch
        ds = tf.data.TFRecordDataset(os.path.join(data_dir, "test.tfrecord")).map(parse)
    if case == "batch_by_rank":  # by hand, 32 on rank 0 and 16 on rank 1
        ds, settings = ds.shard(hk.size(), hk.rank()), dict(sharded=True)
    ds = ds.shuffle(1000, seed=hk.rank() if case == "seed_by_rank" else 0)
    ds = ds.batch(16 if case == "batch_by_rank" and hk.rank() == 1 else 32)
    if case == "cut_inside":  # epoch ends only: the shard runs short before any look
        settings["checkpoint_every"] = 0
    hk.fit(model, ds, epochs=int(epochs), run_dir=run_dir, callbacks=[Cut()], **settings)


if case == "reference":  # the uninterrupted run, then four refusals before step 0
    fit("plain", run_dir + "/whole")
    if hk.rank() == 0:
        shutil.copytree(run_dir + "/whole", run_dir + "/added")
    for sub in ("fewer_files", "seed_by_rank", "batch_by_rank", "added"):
        try:
            fit(sub, run_dir + "/" + sub, data_dir + "-added" if sub == "added" else data_dir)
        except hk.Error as e:
            status = hk.report_error(e)
            if hk.rank() == 0:
                print(f"{{sub}}: exit {{status}}", flush=True)
    sys.exit(0)
try:
    fit(case, run_dir)
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


def ranks_lines(stderr, text):
    return [l for l in stderr.splitlines() if "<stderr>:" in l and text in l]


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    """The example's TFRecord files, the script, and one launch: the uninterrupted 2-epoch
    run, then the four refusals of the next test (one process, one start-up)."""
    import shutil

    import keras_fit_tfrecord as ex
    from conftest import clean_env, result, run, script_cmd
    from hvdtrain.distributed import World

    base = tmp_path_factory.mktemp("fit")
    data_dir = str(base / "data")
    ex.write_tfrecords(data_dir, 7, World())
    shutil.copytree(data_dir, data_dir + "-added")  # an 8th file, empty: the same examples
    open(os.path.join(data_dir + "-added", "train-07-extra.tfrecord"), "wb").close()
    script = base / "fit.py"
    script.write_text(FIT.format(examples=os.path.join(ROOT, "examples")))
    env = clean_env(base / "home")

    def launch(case, data, run_dir, epochs=2, timeout=180):
        return run(script_cmd(2, script, case, data, run_dir, epochs), env, timeout)

    runs = str(base / "runs")
    p = launch("reference", data_dir, runs, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(base=base, data=data_dir, launch=launch, runs=runs, proc=p,
                result=result(runs + "/whole"))


def test_ranks_that_disagree_on_the_input_are_refused_before_step_0(fit_runs):
    """Four refusals (in the fixture's launch, after its uninterrupted run), each one line
    said once, exit 1, nothing written: rank 1 lacks file 05; a shuffle seeded by rank
    before sharding by batch; sharded by hand with batches of 32 and 16; a resume after a
    file was added (an empty one: the examples per epoch the same). Before, each trained
    (exit 0): file 05 by nobody and 06 twice; some examples twice, others never; steps of
    48 examples said to be 64; the 8 files taken for the finished run's 7."""
    p, data, runs = fit_runs["proc"], fit_runs["data"], fit_runs["runs"]
    for sub in ("fewer_files", "seed_by_rank", "batch_by_rank", "added"):
        assert f"{sub}: exit 1" in p.stdout, (sub, p.stdout[-2000:], p.stderr[-3000:])
    assert sorted(os.listdir(runs)) == ["added", "whole"]  # the refused wrote nothing
    lines = {
        "fewer_files": "the training dataset: the ranks read different files: rank 1 lacks "
                       f"{data}/train-05-of-07.tfrecord (7 files on rank 0, 6 on rank 1)",
        "seed_by_rank": "the training dataset: rank 1 reads its batches in another order "
                        "than rank 0 (sharded by batch",
        "batch_by_rank": "the training dataset: rank 1's batches hold 16 examples, rank 0's "
                         "32: every rank's batches must be the per-rank batch size",
        "added": "was made with other settings (the training files 7 files, ",
    }
    for sub, line in lines.items():
        assert len(ranks_lines(p.stderr, line)) == 1, (sub, p.stderr[-3000:])
    added, = ranks_lines(p.stderr, lines["added"])
    assert " -> 8 files, " in added and "examples per epoch" not in added, added
    assert "Traceback" not in p.stderr
    with open(os.path.join(runs, "added", "metrics.jsonl")) as f:
        assert len(f.readlines()) == 2  # the copied run's, untouched


def cut_run(fit_runs, scenario):
    """The fit script's ``scenario`` (it cuts train-03 under the job) on a copy of the data:
    (data, run_dir, the file, its size before, the launch), which must have failed."""
    import shutil

    data, run_dir = (str(fit_runs["base"] / f"{scenario}-data"),
                     str(fit_runs["base"] / scenario))
    shutil.copytree(fit_runs["data"], data)
    path = os.path.join(data, "train-03-of-07.tfrecord")
    size = os.path.getsize(path)
    p = fit_runs["launch"](scenario, data, run_dir)
    assert p.returncode == 1 and "Exit code: 1" in p.stderr, p.stderr[-3000:]
    return data, run_dir, path, size, p


@pytest.mark.parametrize("change", ["cut", "delete"])
def test_file_changed_between_epochs_stops_every_rank_then_resumes_exactly(change, fit_runs):
    """hk.fit, rank 1's file cut in half or deleted after epoch 1 (the script's callback):
    every rank stops before epoch 2 with one line naming the file (cut, it took the next
    epoch's batches, then hung), exit 1, nothing saved after epoch 1; put back, the same
    command resumes from epoch 1's end to the uninterrupted weights."""
    import shutil

    from conftest import checkpoints, result

    data, run_dir, path, size, p = cut_run(fit_runs, change)
    what = (f"cut short under the running job ({size:,} -> {size // 2:,} bytes)"
            if change == "cut" else "deleted under the running job")
    line = f"{path}: {what} before epoch 2: training stopped, nothing saved after it"
    assert len(ranks_lines(p.stderr, line)) == 1, p.stderr[-3000:]
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    steps = fit_runs["result"]["global_step"] // 2
    assert max(step for step, _ in checkpoints(run_dir)) == steps  # epoch 1's end, no later
    shutil.copy(os.path.join(fit_runs["data"], "train-03-of-07.tfrecord"), path)
    again = fit_runs["launch"]("plain", data, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    assert f"at epoch 2, step {steps}" in again.stderr, again.stderr[-3000:]  # resumed there
    assert result(run_dir)["weights_sha256"] == fit_runs["result"]["weights_sha256"]


@pytest.mark.parametrize("change", ["deleted", "cut"])
def test_task_path_file_changed_between_epochs_is_one_line(change, fit_runs, tmp_path):
    """The Task path: a training file deleted, or cut in half, after epoch 1 (the task's
    format_epoch, every rank): every rank stops before epoch 2, one line naming it, exit 1."""
    import shutil

    from conftest import HOROVODRUN, clean_env, run
    from test_pipeline import TASK

    data = str(tmp_path / "data")
    shutil.copytree(fit_runs["data"], data)
    gone = os.path.join(data, "train-02-of-07.tfrecord")
    size = os.path.getsize(gone)
    (tmp_path / "records_task.py").write_text(TASK.format(examples=os.path.join(
        ROOT, "examples")) + DELETING)
    env = clean_env(tmp_path / "home", RECORDS=data, GONE=gone, CHANGE=change)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    p = run([HOROVODRUN, "-np", "2", "--gloo", sys.executable, "-m", "hvdtrain", "run",
             "records_task:Deleting", "--run-dir", str(tmp_path / "run"), "--verbose", "0"],
            env, 180, cwd=str(tmp_path))
    assert p.returncode == 1 and "Exit code: 1" in p.stderr, p.stderr[-3000:]
    what = ("deleted under the running job" if change == "deleted"
            else f"cut short under the running job ({size:,} -> {size // 2:,} bytes)")
    line = f"{gone}: {what} before epoch 2: training stopped, nothing saved after it"
    assert len(ranks_lines(p.stderr, line)) == 1, p.stderr[-3000:]
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]
    assert not (tmp_path / "run" / "result.json").exists()


DELETING = """

class Deleting(Records):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = os.path.getsize(os.environ["GONE"])

    def format_epoch(self, record):  # every rank, after the epoch's checkpoint
        if record["epoch"] == 1 and os.environ["CHANGE"] == "cut":
            os.truncate(os.environ["GONE"], self.size // 2)  # both ranks: the same cut
        elif record["epoch"] == 1 and os.path.exists(os.environ["GONE"]):
            try:
                os.remove(os.environ["GONE"])
            except FileNotFoundError:  # the other rank was first
                pass
        return super().format_epoch(record)
"""


def test_file_cut_inside_an_epoch_stops_every_rank_with_one_line(fit_runs):
    """Rank 1's file cut to a quarter at epoch 2's start, after hk.fit looked at it (the
    script's callback, at a record boundary; checkpoints at epoch ends only): rank 1's shard
    runs short inside the epoch, and rank 1 raises naming the file instead of taking epoch
    3's batches (a hang, before); the watchdog takes its line to rank 0, which says it once,
    and stops every rank. No checkpoint after the cut."""
    from conftest import checkpoints

    _, run_dir, path, size, p = cut_run(fit_runs, "cut_inside")
    line = (f"{path}: cut short under the running job ({size:,} -> {size // 4 - size // 4 % 838:,}"
            " bytes) in epoch 2 (rank 1): training stopped, nothing saved after it")
    said = ranks_lines(p.stderr, line)  # once, by rank 0 (the watchdog took it there)
    assert [l.split("]")[0] for l in said] == ["[0"], p.stderr[-3000:]
    assert said[0].startswith(f"[0]<stderr>:hvdtrain: error: rank 1 failed: {line}"), said
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]
    steps = fit_runs["result"]["global_step"] // 2
    assert [step for step, _ in checkpoints(run_dir)] == [steps]  # epoch 1's alone


def test_resume_on_another_input_names_it_on_the_task_path(tmp_path):
    """The Task path's record holds the pipeline's files and examples per epoch at its top
    level (engine.Run.input): a checkpoint made on other files is refused naming both, as
    the task's flags are named (hk.fit's launch above: the same comparison)."""
    from hvdtrain import checkpoint
    from hvdtrain.config import Config
    from hvdtrain.distributed import World
    from hvdtrain.engine import Checkpoints
    from hvdtrain.errors import CheckpointError

    def record(files, examples):
        return {"task": "records", "seed": 0, "settings": {},
                "train_files": files, "train_examples": examples}

    saved = record("7 files, 3,352,000 bytes, sha256 201788394cca", 3624)
    checkpoint.save(str(tmp_path), [np.zeros(2)], ["w"], {
        "epoch": 1, "offset": 0, "global_step": 57, "run": saved}, keep=2)
    found = Checkpoints(World(), Config(), str(tmp_path), print)
    assert found.find(saved)[0]["global_step"] == 57  # the same input: resumed
    with pytest.raises(CheckpointError) as e:
        found.find(record("8 files, 3,687,200 bytes, sha256 0a1b2c3d4e5f", 4024))
    assert str(e.value) == (
        f"{tmp_path}/ckpt-000000057.hvdt was made with other settings (the training files "
        "7 files, 3,352,000 bytes, sha256 201788394cca -> 8 files, 3,687,200 bytes, sha256 "
        "0a1b2c3d4e5f; the training examples per epoch 3624 -> 4024): resume with the same "
        "settings, or choose a new --run-dir")
