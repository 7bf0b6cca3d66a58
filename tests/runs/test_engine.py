"""One run engine under both paths: the Task path and hk.fit leave the same run directory;
the learning rate reaches a task once, scaled; --elastic without Horovod is one line."""

import json
import os
import textwrap

import pytest

import usercode
from conftest import HOROVODRUN, module_cmd, result, run
from hvdtrain.engine import checkpoint_file as C

# One small classification problem, trained by a Task (python -m hvdtrain run) and by a fit
# script (hvdtrain.keras): the same data, model, optimizer, metric and settings.
COMMON = textwrap.dedent("""
    import numpy as np
    from hvdtrain.compat import keras

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 8)).astype("float32")
        return x, (x[:, 0] + x[:, 1] > 0).astype("int64")

    def model():
        k = keras()
        k.utils.set_random_seed(1)
        return k.Sequential([k.Input((8,)), k.layers.Dense(2, activation="softmax")])
""")
TASK = textwrap.dedent("""
    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data
    import common

    class Small(hvdtrain.Task):
        name = "small"
        defaults = dict(learning_rate=0.1, batch_size=16, epochs=2, checkpoint_every=5)

        def load_data(self, config, world):
            x, y = common.data()
            return Data(x, y, None, None)

        def build_model(self, config):
            return common.model()

        def build_optimizer(self, config, learning_rate):
            # What a task reads: the argument and the config it is handed.
            self.seen = {"argument": learning_rate, "config": config.learning_rate}
            return keras().optimizers.SGD(config.learning_rate)

        def loss(self, y, pred):
            return keras().losses.sparse_categorical_crossentropy(y, pred)

        def metrics(self):
            return {"accuracy": lambda y, p: keras().metrics.sparse_categorical_accuracy(y, p)}

        def summarize(self, model):
            return {"seen_learning_rate": self.seen}
""")
FIT = textwrap.dedent("""
    import sys
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    import common

    hk.init()
    x, y = common.data()
    model = common.model()
    model.compile(optimizer=hk.DistributedOptimizer(keras().optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hk.fit(model, hk.dataset(x, y, batch_size=16, seed=1), epochs=2, run_dir=sys.argv[1],
           checkpoint_every=5, verbose=2)
""")


@pytest.fixture
def code(tmp_path):
    return usercode.write(tmp_path, {"common": COMMON, "small_task": TASK, "small_fit": FIT})


env_with = usercode.env_with


def keys(path):
    with open(path) as f:
        return set(json.load(f))


def test_task_and_fit_write_the_same_run_directory(code, tmp_path):
    env = env_with(code, tmp_path)
    task_dir, fit_dir = str(tmp_path / "task"), str(tmp_path / "fit")
    p = run(["python", "-m", "hvdtrain", "run", "small_task:Small", "--run-dir", task_dir], env)
    assert p.returncode == 0, p.stderr[-2000:]
    p = run(["python", str(code / "small_fit.py"), fit_dir], env)
    assert p.returncode == 0, p.stderr[-2000:]

    def listing(d):
        return sorted(n for n in os.listdir(d) if not n.startswith("."))

    assert (
        listing(task_dir)
        == listing(fit_dir)
        == [
            "checkpoints",
            "config.json",
            "metrics.jsonl",
            "model.keras",
            "result.json",
            "tensorboard",
        ]
    )
    assert keys(f"{task_dir}/config.json") == keys(f"{fit_dir}/config.json")
    task_result, fit_result = result(task_dir), result(fit_dir)
    assert set(task_result) - {"seen_learning_rate"} == set(fit_result)
    assert (task_result["task"], fit_result["task"]) == ("small", "fit")
    for r in (task_result, fit_result):  # 256 examples, 16 a step: 16 steps an epoch
        assert r["global_step"] == 32 and r["train_examples"] == 256 and r["epochs"] == 2
        assert r["final_accuracy"] > 0.5 and r["learning_rate"] == pytest.approx(0.1)

    def lines(d):
        with open(f"{d}/metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    task_lines, fit_lines = lines(task_dir), lines(fit_dir)
    assert [set(r) for r in task_lines] == [set(r) for r in fit_lines]
    assert [r["global_step"] for r in task_lines] == [16, 32]
    # Checkpoints: the same file format, the same metadata and array layout, the same steps
    # (every 5 steps and each epoch end; the newest 3 kept).
    task_ckpts, fit_ckpts = (C.list_checkpoints(f"{d}/checkpoints") for d in (task_dir, fit_dir))
    assert [s for s, _ in task_ckpts] == [s for s, _ in fit_ckpts] == [32, 30, 25]
    (task_meta, task_arrays), (fit_meta, fit_arrays) = (
        C.read(task_ckpts[1][1]),
        C.read(fit_ckpts[1][1]),
    )
    assert set(task_meta) == set(fit_meta)
    assert (
        (task_meta["epoch"], task_meta["offset"])
        == (fit_meta["epoch"], fit_meta["offset"])
        == (1, 14 * 16)
    )
    assert (
        [v[0] for v in task_meta["variables"]][-1]
        == [v[0] for v in fit_meta["variables"]][-1]
        == "metric_sums"
    )
    assert [a.shape for a in task_arrays[:-1]] == [a.shape for a in fit_arrays[:-1]]


def test_a_task_gets_the_scaled_learning_rate_once(code, tmp_path):
    """--scale-lr on 2 ranks: build_optimizer's argument and config.learning_rate are both
    the scaled rate; config.json keeps the flag's value."""
    env = env_with(code, tmp_path)
    run_dir = str(tmp_path / "r")
    p = run(
        [
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            "python",
            "-m",
            "hvdtrain",
            "run",
            "small_task:Small",
            "--scale-lr",
            "--learning-rate",
            "0.05",
            "--run-dir",
            run_dir,
        ],
        env,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = result(run_dir)
    assert r["world_size"] == 2 and r["learning_rate"] == pytest.approx(0.1)
    assert r["seen_learning_rate"] == {"argument": pytest.approx(0.1), "config": pytest.approx(0.1)}
    with open(f"{run_dir}/config.json") as f:
        config = json.load(f)
    assert config["learning_rate"] == 0.05 and config["scale_lr"] is True


def test_elastic_without_horovod_is_one_line(no_horovod, tmp_path):
    p = run(module_cmd("linear", "--elastic", "--run-dir", str(tmp_path / "r")), no_horovod)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--elastic" in lines[0] and "horovod cannot be imported" in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.quick
def test_run_elastic_of_a_world_without_horovod_is_a_launch_error():
    from hvdtrain.base.errors import LaunchError
    from hvdtrain.distributed import World

    with pytest.raises(LaunchError, match="--elastic needs Horovod"):
        World().run_elastic([], lambda state: None, epoch=0)


@pytest.mark.quick
@pytest.mark.parametrize("size", [2, 3, 8])
def test_the_one_allreduce_questions_give_every_rank_one_answer(size):
    """HorovodWorld.all_same and any_true answer from one allreduce_sum, simulated: each
    rank's vector is recorded in a first pass, then every rank asks again and its
    allreduce_sum returns the sum of all ranks' vectors. Equal objects on every rank: the
    same; one rank's object different (the last, or rank 0's): not the same, on every rank."""
    import numpy as np

    from hvdtrain.distributed import HorovodWorld

    def ask(question, values):
        sent = {}

        class Rank(HorovodWorld):
            def __init__(self, rank):
                self.rank, self.size, self.elastic = rank, size, False

            def allreduce_sum(self, vector, name="hvdtrain.sum"):
                sent[self.rank] = np.asarray(vector, dtype=np.float64)
                return sum(sent.values()) if len(sent) == size else np.zeros(len(vector))

        ranks = [Rank(r) for r in range(size)]
        for r in ranks:
            getattr(r, question)(values[r.rank])  # every rank's vector
        answers = {getattr(r, question)(values[r.rank]) for r in ranks}
        assert len(answers) == 1, answers  # one decision on every rank
        return answers.pop()

    model = ("ab12", {"layer 'norm' mean": "[2] float32, sha256 x"})
    other = ("ab13", model[1])
    assert ask("all_same", [model] * size) is True
    assert ask("all_same", [model] * (size - 1) + [other]) is False
    assert ask("all_same", [other] + [model] * (size - 1)) is False
    assert ask("any_true", [False] * size) is False
    assert ask("any_true", [False] * (size - 1) + [True]) is True
