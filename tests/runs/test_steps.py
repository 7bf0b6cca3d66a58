"""Several synchronous steps per compiled call, one Horovod negotiation round per step.

The number of steps per call (--steps-per-execution, 0: tuned) must not change what is
trained: the same weights bit for bit, checkpoints at the same steps. And the step's stop
flags travel in the gradients' grouped allreduce: a Horovod timeline of a real 2-process run
shows one negotiation round per step, not two.
"""

import json
import os
import sys

import pytest

from conftest import HOROVODRUN, KERAS2, clean_env, launch, module_cmd, result, run
from hvdtrain.bench.cases import read_timeline, summarize_timeline


def _train(env, tmp_path, np_, k):
    run_dir = tmp_path / f"np{np_}-k{k}"
    args = [
        "--epochs",
        "2",
        "--learning-rate",
        "0.5",
        "--checkpoint-every",
        "7",
        "--keep-checkpoints",
        "100",
        "--steps-per-execution",
        str(k),
        "--verbose",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    p = run(module_cmd("mnist", *args) if np_ == 1 else launch("gloo", np_, "mnist", *args), env)
    assert p.returncode == 0, p.stderr
    checkpoints = sorted(os.listdir(run_dir / "checkpoints"))
    return result(run_dir), checkpoints


# Under Keras 2 on 2 ranks (Horovod's wrapper reduces inside the compiled loop); one process
# has no wrapper, and the loop is hvdtrain's under either Keras.
@pytest.mark.parametrize("np_", [1, pytest.param(2, marks=pytest.mark.keras2)])
def test_steps_per_call_do_not_change_what_is_trained(np_, env, tmp_path):
    one, ckpt_one = _train(env, tmp_path, np_, 1)
    for k in (5, 0):  # 5 does not divide the checkpoint interval (7); 0 tunes itself
        other, ckpt_other = _train(env, tmp_path, np_, k)
        assert other["weights_sha256"] == one["weights_sha256"], k
        assert other["global_step"] == one["global_step"] == 2 * 4000 // (100 * np_)
        assert other["test_accuracy"] == one["test_accuracy"]
        assert ckpt_other == ckpt_one  # the same steps: every 7th and each epoch end
    assert other["ranks_identical"] is True
    assert len(ckpt_one) == one["global_step"] // 7 + 2


@pytest.mark.keras2
def test_one_negotiation_round_per_step(env, tmp_path):
    """The gradients and the [stop, diverged] flags: one grouped allreduce per step."""
    timeline = tmp_path / "timeline.json"
    p = run(
        launch(
            "mpi",
            2,
            "mnist",
            "--epochs",
            "2",
            "--checkpoint-every",
            "0",
            "--verbose",
            "0",
            "--run-dir",
            str(tmp_path / "r"),
        ),
        dict(env, HOROVOD_TIMELINE=str(timeline)),
    )
    assert p.returncode == 0, p.stderr
    steps = result(tmp_path / "r")["global_step"]
    assert steps == 40
    events = read_timeline(str(timeline))
    tensors = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    # The step's one grouped allreduce: kernel and bias gradients, and the two flags.
    grouped = sorted(t for t in tensors.values() if "GroupedAllreduce" in t)
    assert [t[-4:] for t in grouped] == ["1of3", "2of3", "3of3"], tensors
    assert not any("stop" in t for t in tensors.values()), tensors  # no allreduce of its own
    negotiated = [
        tensors[e["pid"]]
        for e in events
        if e.get("ph") == "B" and e.get("name") == "NEGOTIATE_ALLREDUCE"
    ]
    assert all(negotiated.count(t) == steps for t in grouped)
    # Between the first step and the last, 4 host rounds per epoch: the metric sums, the
    # epoch record's and the checkpoint's write checks, the ranks' agreement before it
    # (World.any_true, World.all_same); in the whole run 14 more (the start's and the end's
    # agreement questions, the final scoring): not one per step.
    rounds = summarize_timeline(str(timeline))
    assert steps < rounds["training_rounds"] <= steps + 4 * 2, rounds
    assert rounds["allreduce_rounds"] <= steps + 4 * 2 + 16 < 2 * steps, rounds


RIDERS = """
import json
import sys

import tensorflow as tf

import hvdtrain
from hvdtrain.compat import keras
from hvdtrain.distributed.optimizer import apply_gradients

world = hvdtrain.world()
k = keras()
out = {}
for op in sys.argv[1].split(","):  # one model and wrapper per op, in one launch
    try:
        model = k.Sequential([k.Input((3,)), k.layers.Dense(1, kernel_initializer="ones")])
        opt = hvdtrain.DistributedOptimizer(k.optimizers.SGD(0.1), op=op)
        opt.build(model.trainable_variables)
    except ValueError as e:  # refused at construction, on every rank alike
        out[op] = str(e)
        continue

    @tf.function
    def step(x, flags):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return apply_gradients(opt, grads, model.trainable_variables, [flags])[0]

    # Rank 1 alone raises the first flag: every rank must see it; the second stays 0.
    flags = step(tf.ones([4, 3]) * (world.rank + 1), tf.constant([float(world.rank), 0.0]))
    out[op] = [flags.numpy().tolist(), model.weights[0].numpy().ravel().tolist()]
with open(f"{sys.argv[2]}/rank{world.rank}.json", "w") as f:
    json.dump(out, f)
"""
OPS = ("average", "sum", "adasum")


@pytest.fixture(scope="module")
def riders(tmp_path_factory):
    """One 2-rank launch that steps one model per op (the three cases below read it)."""
    tmp = tmp_path_factory.mktemp("riders")
    script = tmp / "riders.py"
    script.write_text(RIDERS)
    p = run(
        [HOROVODRUN, "-np", "2", "--mpi", sys.executable, str(script), ",".join(OPS), str(tmp)],
        clean_env(tmp / "home"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.keras2
@pytest.mark.parametrize(
    "op, flag, kernel",
    [
        # kernel gradients 6 (rank 0) and 24 (rank 1) per weight, lr 0.1, initial weights 1:
        ("average", 0.5, -0.5),  # mean 15
        ("sum", 1.0, -2.0),  # 30
        ("adasum", 1.0, -0.5),  # Adasum of parallel 6 and 24: -1 * 6 + 0.875 * 24 = 15; the
    ],
)  # flags then travel in a sum of their own
def test_flags_ride_with_every_reduction(op, flag, kernel, riders):
    """The step's flags reach every rank whatever the wrapper's op; Adasum included, which
    Horovod's grouped allreduce cannot do (hvdtrain reduces it tensor by tensor)."""
    if op == "adasum" and KERAS2:  # Horovod's own Keras 2 wrapper refuses it, in its words
        assert all("only supports Average and Sum" in r[op] for r in riders), riders
        return
    for rank in (0, 1):
        flags, weights = riders[rank][op]
        assert flags == [flag, 0.0], (rank, flags)
        assert weights == pytest.approx([kernel] * 3), (rank, weights)
