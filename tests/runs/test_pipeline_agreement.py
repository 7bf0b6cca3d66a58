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

    return (
        tf.data.Dataset.from_tensor_slices([str(f) for f in files])
        .interleave(tf.data.TFRecordDataset, cycle_length=2)
        .map(parse)
    )


@pytest.mark.quick
def test_agreement_lines_name_the_rank_and_what_differs():
    from hvdtrain.inputs import sources

    a = [("/d/part-0", 100), ("/d/part-1", 90), ("/d/part-2", 80)]
    same = sources.files_differ("the training dataset", [a, list(a)])
    assert same is None
    assert sources.files_differ("the training dataset", [a, a[:2]]) == (
        "the training dataset: the ranks read different files: rank 1 lacks /d/part-2 (3 "
        "files on rank 0, 2 on rank 1); every rank must list the same files (or shard them "
        "by hand: sharded=True)"
    )
    assert (
        "rank 1 lists them in another order (file 0: /d/part-1 where rank 0 has "
        "/d/part-0)" in sources.files_differ("x", [a, [a[1], a[0], a[2]]])
    )
    assert "/d/part-1 is 90 bytes on rank 0, 45 on rank 1" in sources.files_differ(
        "x", [a, [a[0], ("/d/part-1", 45), a[2]]]
    )
    assert sources.order_differs("x", ["ab", "ab", "ab"]) is None
    assert sources.order_differs("x", ["ab", "ab", "cd"]).startswith(
        "x: rank 2 reads its batches in another order than rank 0"
    )
    assert sources.batch_sizes_differ("x", [32, 32], "user") is None
    assert sources.batch_sizes_differ("x", [32, 16], "user") == (
        "x: rank 1's batches hold 16 examples, rank 0's 32: every rank's batches must be the "
        "per-rank batch size (batch every rank's shard alike)"
    )
    # The run-defining description: names (not the directory) and sizes.
    moved = [("/e/part-0", 100), ("/e/part-1", 90), ("/e/part-2", 80)]
    assert sources.describe_files(a) == sources.describe_files(moved)
    assert sources.describe_files(a).startswith("3 files, 270 bytes, sha256 ")
    assert sources.describe_files(a) != sources.describe_files(a + [("/d/part-3", 1)])
    assert sources.describe_files([]) == "none"


@pytest.mark.quick
def test_by_batch_order_digest_catches_a_shuffle_seeded_by_rank(records):
    """Sharded by batch, every rank counts the whole pipeline and digests its batches: the
    same seed on every rank gives the same digest, another seed (seed=rank) another; the
    rank's own sizes from the whole count are those of its shard."""
    import tensorflow as tf

    from hvdtrain.inputs import sharding

    def sharded(seed, batch=None):
        ds = examples(sorted(records.glob("part-*")))
        ds = ds.shuffle(160, seed=seed)
        return sharding.sharded_sizes(
            ds if batch else ds.batch(16), Twin(), False, "x", batch=batch
        )

    ds0, sizes, policy, digest = sharded(0)
    assert (policy, sizes) == ("file", [16] * 5) and digest is None  # by file: no digest

    class Rank1(Twin):
        rank = 1

    whole = tf.data.Dataset.range(50).map(lambda i: (tf.cast([i], tf.float32), i))
    digests = []
    for seed in (0, 0, 1):
        ds = whole.shuffle(50, seed=seed).batch(8)
        _, sizes, policy, d = sharding.sharded_sizes(ds, Twin(), False, "x")
        assert (policy, sizes) == ("data", [8, 8, 8, 2])  # batches 0, 2, 4, 6 of 7
        digests.append(d)
    assert digests[0] == digests[1] != digests[2]
    # Examples, batched per rank after sharding (the Task path): rank 1's sizes from the
    # whole count equal its shard's own.
    for rank in (Twin(), Rank1()):
        mine, sizes, _, _ = sharding.sharded_sizes(whole, rank, False, "x", batch=8)
        assert sizes == [int(tf.shape(x)[0]) for x, _ in mine] == [8, 8, 8, 1]


@pytest.mark.quick
def test_enumerate_over_files_is_sharded_by_batch(records):
    """A TFRecord pipeline with .enumerate(): TensorFlow's file rewrite cannot shard its
    range source (a 57-line protobuf dump); sharded by batch instead, every example once."""
    from hvdtrain.inputs import pipeline

    class Rank1(Twin):
        rank = 1

    ids = []
    for rank in (Twin(), Rank1()):
        ds = (
            examples(sorted(records.glob("part-*")))
            .enumerate()
            .map(lambda k, xy: (xy[0], xy[1]))
            .batch(10)
        )
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

    from hvdtrain.base.errors import DataError, InputError
    from hvdtrain.distributed import World
    from hvdtrain.inputs import pipeline, sources

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
    open(files[3], "wb").write(raw[: size // 2 - (size // 2) % (size // 40)])  # whole records
    with pytest.raises(InputError) as e:
        train.check_unchanged("before epoch 2")
    assert str(e.value).startswith(f"{files[3]}: cut short under the running job ({size:,} -> ")
    assert " bytes) before epoch 2: training stopped, nothing saved after it; " in str(e.value)
    with pytest.raises(tf.errors.FailedPreconditionError) as short:
        for _ in range(10):
            next(stream)  # epoch 2: 9 batches, then the end instead of epoch 3's first
    line = str(train.failure(short.value, 1))
    assert (
        line.startswith(f"{files[3]}: cut short under the running job")
        and "in epoch 2 (rank 0): training stopped" in line
    )
    train.snapshot = sources.stat_files(train.snapshot)  # as if it had been so from the start
    assert str(train.failure(short.value, 1)).startswith(
        "the training dataset: rank 0's shard ended after 9 of its 10 batches in epoch 2 "
        "(rank 0): its input changed under the running job"
    )
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
        if epoch == 0 and case == "unreadable":  # launched as root without its override
            os.chmod(CUT, 0)
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


def said_once_that_rank_1s_file_was_cut(p, path, size):
    """Rank 1's file at PATH, SIZE bytes, cut to a quarter (at a record boundary, 838 bytes a
    record) in epoch 2: one line naming it, said once by rank 0 (the watchdog took it there),
    no traceback on any rank."""
    line = (
        f"{path}: cut short under the running job ({size:,} -> {size // 4 - size // 4 % 838:,}"
        " bytes) in epoch 2 (rank 1): training stopped, nothing saved after it"
    )
    said = ranks_lines(p.stderr, line)
    assert [l.split("]")[0] for l in said] == ["[0"], p.stderr[-3000:]
    assert said[0].startswith(f"[0]<stderr>:hvdtrain: error: rank 1 failed: {line}"), said
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    """The example's TFRecord files, the script, and one launch: the uninterrupted 2-epoch
    run, then the four refusals of the next test (one process, one start-up)."""
    import shutil

    import keras_fit_tfrecord as ex

    from conftest import NO_DAC, clean_env, result, run, script_cmd
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
        # "unreadable": a file's mode bits must apply to the ranks, root's included
        prefix = NO_DAC if case == "unreadable" else []
        return run([*prefix, *script_cmd(2, script, case, data, run_dir, epochs)], env, timeout)

    runs = str(base / "runs")
    p = launch("reference", data_dir, runs, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(
        base=base, data=data_dir, launch=launch, runs=runs, proc=p, result=result(runs + "/whole")
    )


def refused_once_each(p, runs, lines):
    """A launch's refusals ({case: its line}), either path: each case exit 1, its line said
    once, no traceback, nothing written beside the whole run and the copy resumed as
    "added", whose line names the 8 files and not the examples per epoch (the same)."""
    for sub in lines:
        assert f"{sub}: exit 1" in p.stdout, (sub, p.stdout[-2000:], p.stderr[-3000:])
    assert sorted(os.listdir(runs)) == ["added", "whole"]  # the refused wrote nothing
    for sub, line in lines.items():
        assert len(ranks_lines(p.stderr, line)) == 1, (sub, p.stderr[-3000:])
    (added,) = ranks_lines(p.stderr, lines["added"])
    assert " -> 8 files, " in added and "examples per epoch" not in added, added
    assert "Traceback" not in p.stderr


def test_ranks_that_disagree_on_the_input_are_refused_before_step_0(fit_runs):
    """Four refusals (in the fixture's launch, after its uninterrupted run), each one line
    said once, exit 1, nothing written: rank 1 lacks file 05; a shuffle seeded by rank
    before sharding by batch; sharded by hand with batches of 32 and 16; a resume after a
    file was added (an empty one: the examples per epoch the same). Before, each trained
    (exit 0): file 05 by nobody and 06 twice; some examples twice, others never; steps of
    48 examples said to be 64; the 8 files taken for the finished run's 7."""
    p, data, runs = fit_runs["proc"], fit_runs["data"], fit_runs["runs"]
    refused_once_each(
        p,
        runs,
        {
            "fewer_files": "the training dataset: the ranks read different files: rank 1 lacks "
            f"{data}/train-05-of-07.tfrecord (7 files on rank 0, 6 on rank 1)",
            "seed_by_rank": "the training dataset: rank 1 reads its batches in another order "
            "than rank 0 (sharded by batch",
            "batch_by_rank": "the training dataset: rank 1's batches hold 16 examples, rank 0's "
            "32: every rank's batches must be the per-rank batch size",
            "added": "was made with other settings (the training files 7 files, ",
        },
    )
    with open(os.path.join(runs, "added", "metrics.jsonl")) as f:
        assert len(f.readlines()) == 2  # the copied run's, untouched


def cut_run(fit_runs, scenario):
    """The fit script's ``scenario`` (it cuts train-03 under the job) on a copy of the data:
    (data, run_dir, the file, its size before, the launch), which must have failed."""
    import shutil

    data, run_dir = (str(fit_runs["base"] / f"{scenario}-data"), str(fit_runs["base"] / scenario))
    shutil.copytree(fit_runs["data"], data)
    path = os.path.join(data, "train-03-of-07.tfrecord")
    size = os.path.getsize(path)
    p = fit_runs["launch"](scenario, data, run_dir)
    assert p.returncode == 1 and "Exit code: 1" in p.stderr, p.stderr[-3000:]
    return data, run_dir, path, size, p


@pytest.mark.parametrize("change", ["cut", "delete", "unreadable"])
def test_file_changed_between_epochs_stops_every_rank_then_resumes_exactly(change, fit_runs):
    """hk.fit, rank 1's file cut in half, deleted or made unreadable (mode 000, the ranks
    root without its override) after epoch 1 (the script's callback):
    every rank stops before epoch 2 with one line naming the file (cut, it took the next
    epoch's batches, then hung), exit 1, nothing saved after epoch 1; put back, the same
    command resumes from epoch 1's end to the uninterrupted weights."""
    import shutil

    from conftest import checkpoints, result

    data, run_dir, path, size, p = cut_run(fit_runs, change)
    what = {
        "cut": f"cut short under the running job ({size:,} -> {size // 2:,} bytes)",
        "delete": "deleted under the running job",
        "unreadable": "unreadable (Permission denied) under the running job",
    }[change]
    line = f"{path}: {what} before epoch 2: training stopped, nothing saved after it"
    assert len(ranks_lines(p.stderr, line)) == 1, p.stderr[-3000:]
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    steps = fit_runs["result"]["global_step"] // 2
    assert max(step for step, _ in checkpoints(run_dir)) == steps  # epoch 1's end, no later
    shutil.copy(os.path.join(fit_runs["data"], "train-03-of-07.tfrecord"), path)  # mode too
    again = fit_runs["launch"]("plain", data, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    assert f"at epoch 2, step {steps}" in again.stderr, again.stderr[-3000:]  # resumed there
    assert result(run_dir)["weights_sha256"] == fit_runs["result"]["weights_sha256"]


# --- the Task path: the same cases, launched ----------------------------------------------------

TASKS = """

class Deleting(Records):  # a training file changed after epoch 1's checkpoint, every rank
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = os.path.getsize(os.environ["GONE"])

    def format_epoch(self, record):  # every rank, after the epoch's checkpoint
        change, gone = os.environ["CHANGE"], os.environ["GONE"]
        if record["epoch"] == 1 and change == "cut":
            os.truncate(gone, self.size // 2)  # both ranks: the same cut
        elif record["epoch"] == 1 and change == "unreadable":  # root without its override
            os.chmod(gone, 0)
        elif record["epoch"] == 1 and change == "deleted" and os.path.exists(gone):
            try:
                os.remove(gone)
            except FileNotFoundError:  # the other rank was first
                pass
        return super().format_epoch(record)


class CutInside(Records):
    \"\"\"GONE cut to a quarter (whole records) at the first example read in epoch 2, after
    the look before epoch 2 (checkpoints at epoch ends only): its reader, open already or
    not yet, gets a quarter of it, or what it had buffered.\"\"\"
    armed = False

    def load_data(self, config, world):
        gone = os.environ["GONE"]
        keep = os.path.getsize(gone) // 4 - os.path.getsize(gone) // 4 % 838
        done = []

        def cut(y):
            if CutInside.armed and not done:
                done.append(True)
                os.truncate(gone, keep)
            return y

        def hooked(x, y):
            with tf.control_dependencies([tf.py_function(cut, [y], Tout=tf.int64)]):
                return tf.identity(x), y
        # Records' pipeline with the hook before the shuffle: at the epoch's first example
        # read, before the shuffle's buffer reads the rest
        files = hk.files(os.path.join(os.environ["RECORDS"], "train-*.tfrecord"))
        train = _examples(files).map(hooked).shuffle(1000, seed=config.seed)
        return Data(train, None, None, None)

    def format_epoch(self, record):
        CutInside.armed = CutInside.armed or record["epoch"] == 1
        return super().format_epoch(record)


def _examples(files):
    return tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=4).map(parse)


class FewerFiles(Records):  # rank 1 lacks file 05
    def load_data(self, config, world):
        files = hk.files(os.path.join(os.environ["RECORDS"], "train-*.tfrecord"))
        if world.rank == 1:
            files = files[:5] + files[6:]
        return Data(_examples(files).shuffle(1000, seed=config.seed), None, None, None)


class SeedByRank(Records):  # one file: sharded by batch, after a shuffle seeded by rank
    def load_data(self, config, world):
        one = tf.data.TFRecordDataset(os.path.join(os.environ["RECORDS"], "test.tfrecord"))
        return Data(one.map(parse).shuffle(1000, seed=world.rank), None, None, None)
"""

# One launch: the uninterrupted Task run, then the refusals before step 0 (one process, one
# start-up), as the fit script's "reference" case does.
TASK_RUNS = """
import os, shutil, sys
import hvdtrain
import hvdtrain.keras as hk
from records_task import FewerFiles, Records, SeedByRank

data, runs = sys.argv[1:3]
hk.init()


def train(cls, sub, records):
    os.environ["RECORDS"] = records
    task = cls()
    hvdtrain.train(task, task.config(run_dir=os.path.join(runs, sub), verbose=0))


train(Records, "whole", data)
if hk.rank() == 0:  # the whole run's checkpoints, the run not finished: a resume
    shutil.copytree(os.path.join(runs, "whole"), os.path.join(runs, "added"))
    os.remove(os.path.join(runs, "added", "result.json"))
for sub, cls, records in (("fewer_files", FewerFiles, data), ("seed_by_rank", SeedByRank, data),
                          ("added", Records, data + "-added")):
    try:
        train(cls, sub, records)
    except hk.Error as e:
        status = hk.report_error(e)
        if hk.rank() == 0:
            print(f"{sub}: exit {status}", flush=True)
"""


@pytest.fixture(scope="module")
def task_runs(fit_runs):
    """records_task.py (test_pipeline's Records task and the cases above) and one launch of
    TASK_RUNS on the fit script's files."""
    from test_pipeline import TASK

    from conftest import HOROVODRUN, clean_env, result, run

    base = fit_runs["base"] / "task"
    base.mkdir()
    (base / "records_task.py").write_text(
        TASK.format(examples=os.path.join(ROOT, "examples")) + TASKS
    )
    (base / "task_runs.py").write_text(TASK_RUNS)
    env = clean_env(base / "home")
    env["PYTHONPATH"] = f"{base}:{env['PYTHONPATH']}"
    runs = str(base / "runs")
    p = run(
        [
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            sys.executable,
            str(base / "task_runs.py"),
            fit_runs["data"],
            runs,
        ],
        env,
        240,
        cwd=str(base),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(base=base, env=env, proc=p, runs=runs, result=result(os.path.join(runs, "whole")))


def test_task_path_ranks_that_disagree_on_the_input_are_refused_before_step_0(task_runs, fit_runs):
    """The Task path's refusals (its launch, after the uninterrupted run): rank 1 lacks file
    05; a shuffle seeded by rank before hvdtrain shards by batch; a resume (the whole run's
    checkpoints, its result.json removed) on a file added. Each one line said once, exit 1,
    nothing written. (Batches of another size on one rank cannot happen here: hvdtrain
    batches the task's examples. A finished run's result stands, as for the same command
    again: the Task path reads its input after that check.)"""
    p, data, runs = task_runs["proc"], fit_runs["data"], task_runs["runs"]
    refused_once_each(
        p,
        runs,
        {
            # the Task's x_train: the name its Data gives the training dataset
            "fewer_files": "x_train: the ranks read different files: rank 1 lacks "
            f"{data}/train-05-of-07.tfrecord (7 files on rank 0, 6 on rank 1)",
            "seed_by_rank": "x_train: rank 1 reads its batches in another order than rank 0 "
            "(sharded by batch",
            "added": "was made with other settings (the training files 7 files, ",
        },
    )
    assert task_runs["result"]["global_step"] > 0 and task_runs["result"]["ranks_identical"]


def task_launch(task_runs, tmp_path, task, run_dir, **env):
    """``python -m hvdtrain run records_task:TASK`` on 2 ranks (root without its override
    for CHANGE=unreadable)."""
    from conftest import HOROVODRUN, NO_DAC, run

    prefix = NO_DAC if env.get("CHANGE") == "unreadable" else []
    return run(
        [
            *prefix,
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            sys.executable,
            "-m",
            "hvdtrain",
            "run",
            f"records_task:{task}",
            "--run-dir",
            str(run_dir),
            "--verbose",
            "0",
            "--checkpoint-every",
            "0",
        ],
        dict(task_runs["env"], **env),
        180,
        cwd=str(tmp_path),
    )


@pytest.mark.parametrize("change", ["deleted", "cut", "unreadable"])
def test_task_path_file_changed_between_epochs_is_one_line(change, fit_runs, task_runs, tmp_path):
    """The Task path: a training file deleted, cut in half or made unreadable after epoch 1
    (the task's format_epoch, every rank): every rank stops before epoch 2, one line naming
    it, exit 1, nothing saved after epoch 1. Put back as it was, the same command resumes
    from epoch 1's end to the uninterrupted run's weights."""
    import shutil

    from conftest import checkpoints, result

    data = str(tmp_path / "data")
    shutil.copytree(fit_runs["data"], data)
    gone = os.path.join(data, "train-02-of-07.tfrecord")
    size = os.path.getsize(gone)
    run_dir = tmp_path / "run"
    p = task_launch(
        task_runs, tmp_path, "Deleting", run_dir, RECORDS=data, GONE=gone, CHANGE=change
    )
    assert p.returncode == 1 and "Exit code: 1" in p.stderr, p.stderr[-3000:]
    what = {
        "deleted": "deleted under the running job",
        "cut": f"cut short under the running job ({size:,} -> {size // 2:,} bytes)",
        "unreadable": "unreadable (Permission denied) under the running job",
    }[change]
    line = f"{gone}: {what} before epoch 2: training stopped, nothing saved after it"
    assert len(ranks_lines(p.stderr, line)) == 1, p.stderr[-3000:]
    assert "Traceback" not in "".join(ranks_lines(p.stderr, "")), p.stderr[-3000:]
    assert not (run_dir / "result.json").exists()
    whole = task_runs["result"]
    assert [step for step, _ in checkpoints(run_dir)] == [whole["global_step"] // 2]
    shutil.copy(os.path.join(fit_runs["data"], "train-02-of-07.tfrecord"), gone)  # mode too
    again = task_launch(task_runs, tmp_path, "Records", run_dir, RECORDS=data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at epoch 2, step {whole['global_step'] // 2}" in again.stdout + again.stderr
    assert result(run_dir)["weights_sha256"] == whole["weights_sha256"]  # nothing lost


def test_task_path_file_cut_inside_an_epoch_stops_every_rank_with_one_line(
    fit_runs, task_runs, tmp_path
):
    """The Task path: rank 1's file cut to a quarter at the first example read in epoch 2,
    after the look before it (the task's map, every rank; checkpoints at epoch ends only):
    rank 1's shard runs short inside the epoch and rank 1 stops naming the file, instead of
    taking epoch 3's batches or leaving rank 0 waiting; rank 0 says it once. No checkpoint
    after the cut."""
    import shutil

    from conftest import checkpoints

    data = str(tmp_path / "data")
    shutil.copytree(fit_runs["data"], data)
    path = os.path.join(data, "train-03-of-07.tfrecord")  # rank 1's (files 1, 3, 5)
    size = os.path.getsize(path)
    run_dir = tmp_path / "run"
    p = task_launch(task_runs, tmp_path, "CutInside", run_dir, RECORDS=data, GONE=path)
    assert p.returncode == 1 and "Exit code: 1" in p.stderr, p.stderr[-3000:]
    said_once_that_rank_1s_file_was_cut(p, path, size)
    assert not (run_dir / "result.json").exists()
    assert [step for step, _ in checkpoints(run_dir)] == [task_runs["result"]["global_step"] // 2]


def test_file_cut_inside_an_epoch_stops_every_rank_with_one_line(fit_runs):
    """Rank 1's file cut to a quarter at epoch 2's start, after hk.fit looked at it (the
    script's callback, at a record boundary; checkpoints at epoch ends only): rank 1's shard
    runs short inside the epoch, and rank 1 raises naming the file instead of taking epoch
    3's batches (a hang, before); the watchdog takes its line to rank 0, which says it once,
    and stops every rank. No checkpoint after the cut."""
    from conftest import checkpoints

    _, run_dir, path, size, p = cut_run(fit_runs, "cut_inside")
    said_once_that_rank_1s_file_was_cut(p, path, size)
    steps = fit_runs["result"]["global_step"] // 2
    assert [step for step, _ in checkpoints(run_dir)] == [steps]  # epoch 1's alone


def test_resume_on_another_input_names_it_on_the_task_path(tmp_path):
    """The Task path's record holds the pipeline's files and examples per epoch at its top
    level (engine.Run.input): a checkpoint made on other files is refused naming both, as
    the task's flags are named (hk.fit's launch above: the same comparison)."""
    from hvdtrain.base.config import Config
    from hvdtrain.base.errors import CheckpointError
    from hvdtrain.distributed import World
    from hvdtrain.engine import checkpoint_file
    from hvdtrain.engine.checkpoints import Checkpoints

    def record(files, examples):
        return {
            "task": "records",
            "seed": 0,
            "settings": {},
            "train_files": files,
            "train_examples": examples,
        }

    saved = record("7 files, 3,352,000 bytes, sha256 201788394cca", 3624)
    checkpoint_file.save(
        str(tmp_path),
        [np.zeros(2)],
        ["w"],
        {"epoch": 1, "offset": 0, "global_step": 57, "run": saved},
        keep=2,
    )
    found = Checkpoints(World(), Config(), str(tmp_path), print)
    assert found.find(saved)[0]["global_step"] == 57  # the same input: resumed
    with pytest.raises(CheckpointError) as e:
        found.find(record("8 files, 3,687,200 bytes, sha256 0a1b2c3d4e5f", 4024))
    assert str(e.value) == (
        f"{tmp_path}/ckpt-000000057.hvdt was made with other settings (the training files "
        "7 files, 3,352,000 bytes, sha256 201788394cca -> 8 files, 3,687,200 bytes, sha256 "
        "0a1b2c3d4e5f; the training examples per epoch 3624 -> 4024): resume with the same "
        "settings, or choose a new --run-dir"
    )
