"""Several synchronous steps per compiled call, one Horovod negotiation round per step.

The number of steps per call (--steps-per-execution, 0: tuned) must not change what is
trained: the same weights bit for bit, checkpoints at the same steps. And the step's stop
flags travel in the gradients' grouped allreduce: a Horovod timeline of a real 2-process run
shows one negotiation round per step, not two.
"""
import os

import pytest

from conftest import launch, module_cmd, result, run
from hvdtrain.bench.cases import read_timeline, summarize_timeline


def _train(env, tmp_path, np_, k, *extra):
    run_dir = tmp_path / f"np{np_}-k{k}"
    args = ["--epochs", "2", "--learning-rate", "0.5", "--checkpoint-every", "7",
            "--keep-checkpoints", "100", "--steps-per-execution", str(k), "--verbose", "0",
            "--run-dir", str(run_dir), *extra]
    p = run(module_cmd("mnist", *args) if np_ == 1 else launch("gloo", np_, "mnist", *args),
            env)
    assert p.returncode == 0, p.stderr
    checkpoints = sorted(os.listdir(run_dir / "checkpoints"))
    return result(run_dir), checkpoints


@pytest.mark.keras2
@pytest.mark.parametrize("np_", [1, 2])
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
    p = run(launch("mpi", 2, "mnist", "--epochs", "2", "--checkpoint-every", "0",
                   "--verbose", "0", "--run-dir", str(tmp_path / "r")),
            dict(env, HOROVOD_TIMELINE=str(timeline)))
    assert p.returncode == 0, p.stderr
    steps = result(tmp_path / "r")["global_step"]
    assert steps == 40
    events = read_timeline(str(timeline))
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    # The step's one grouped allreduce: kernel and bias gradients, and the two flags.
    grouped = sorted(t for t in tensors.values() if "GroupedAllreduce" in t)
    assert [t[-4:] for t in grouped] == ["1of3", "2of3", "3of3"], tensors
    assert not any("stop" in t for t in tensors.values()), tensors  # no allreduce of its own
    negotiated = [tensors[e["pid"]] for e in events
                  if e.get("ph") == "B" and e.get("name") == "NEGOTIATE_ALLREDUCE"]
    assert all(negotiated.count(t) == steps for t in grouped)
    # Outside the steps, a few per epoch (metric sums, the epoch-end checkpoint's) and per run.
    rounds = summarize_timeline(str(timeline))["allreduce_rounds"]
    assert steps < rounds <= steps + 3 * 2, rounds
