"""The commands that open the checkpoints, mixed-precision and faults guides
(docs/guides/checkpoints.md, mixed-precision.md, faults.md), run as printed on two processes
with the real horovodrun, and what the pages say of them: two epochs and then the same run
continued to four end with the weights of one uninterrupted 4-epoch run (a fourth launch,
which is also the float32 run of the mixed-precision command), its metrics.jsonl one line per
epoch; bfloat16 learns the weights to 1e-3 where float32 gets 1e-6, the ranks identical (a
task whose loss takes the model's output as it is: the pre-flight check must give it float32,
as the step does); the faults page's, stopped by Ctrl-C after two epochs, exits 75 with the
page's one line, and run again ends with the weights of a run never stopped."""

import json
import os
import re
import signal

import pytest

from conftest import as_printed, clean_env, finish, result, run, start, wait_for
from docs_pages import block

RESUME = block(
    "guides/checkpoints.md", "horovodrun -np 2 python -m hvdtrain.linear --batch-size 10 --epochs 2"
).commands()
(BF16,) = block(
    "guides/mixed-precision.md", "horovodrun -np 2 python -m hvdtrain.linear --mixed-precision"
).commands()
(STOP,) = block(
    "guides/faults.md", "horovodrun -np 2 python -m hvdtrain.linear --batch-size 1"
).commands()
STOPPED = block("guides/faults.md", "python -m hvdtrain.linear: stopped by SIGTERM").text.strip()
# The float32 run: the mixed-precision command at the default precision, 4 epochs, which is
# also the uninterrupted run of the checkpoints page's second command.
FLOAT32 = BF16.replace("--mixed-precision bfloat16 ", "").replace("runs/bf16", "runs/whole")


def read(run_dir, name):
    """config.json (a JSON object) or metrics.jsonl (one per line) of ``run_dir``;
    result.json is conftest's ``result``."""
    with open(os.path.join(run_dir, name)) as f:
        return json.load(f) if name.endswith(".json") else [json.loads(l) for l in f if l.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("openings")
    env = clean_env(cwd / "home")
    out = {}
    for name, line in (
        ("first", RESUME[0]),
        ("continued", RESUME[1]),
        ("bf16", BF16),
        ("whole", FLOAT32),
    ):
        p = run(as_printed(line), env, timeout=180, cwd=str(cwd))
        assert p.returncode == 0, (line, p.stderr[-3000:])
        out[name] = p
        if name == "first":  # what the first command left for the second
            out["first_result"] = result(cwd / "runs" / "lin")
    out["cwd"] = cwd
    return out


def test_the_checkpoints_pages_commands_continue_one_run(runs):
    assert RESUME[1] == RESUME[0].replace("--epochs 2", "--epochs 4")
    first, cwd = runs["first_result"], runs["cwd"]
    assert (first["global_step"], first["epochs"]) == (100, 2)  # "global step 100"
    continued, whole = result(cwd / "runs" / "lin"), result(cwd / "runs" / "whole")
    assert continued["global_step"] == whole["global_step"] == 200
    assert continued["weights_sha256"] == whole["weights_sha256"]
    assert continued["ranks_identical"] is True
    epochs = [m["epoch"] for m in read(cwd / "runs" / "lin", "metrics.jsonl")]
    assert epochs == [1, 2, 3, 4]
    # the second command trained only epochs 3 and 4 (the linear task's "Epoch: 3  Step: 150")
    said = [
        l.split("Epoch: ", 1)[1].split()[:3]
        for l in runs["continued"].stdout.splitlines()
        if "Epoch: " in l
    ]
    assert said == [["3", "Step:", "150"], ["4", "Step:", "200"]], said


def test_the_mixed_precision_pages_command(runs):
    cwd = runs["cwd"]
    bf16, f32 = result(cwd / "runs" / "bf16"), result(cwd / "runs" / "whole")
    settings = (
        read(cwd / "runs" / "bf16", "config.json"),
        read(cwd / "runs" / "whole", "config.json"),
    )
    assert [c["mixed_precision"] for c in settings] == ["bfloat16", "none"]
    assert bf16["ranks_identical"] is True and bf16["global_step"] == f32["global_step"] == 200
    truth = [0.1, 0.2, 0.3, 0.4]
    learned = {name: r["weights"] + [r["bias"]] for name, r in (("bf16", bf16), ("f32", f32))}
    assert learned["f32"] == pytest.approx(truth, abs=1e-6)
    assert learned["bf16"] == pytest.approx(truth, abs=1e-3)
    # it did compute in 16 bits: further from the truth than float32, and not by nothing
    assert max(abs(a - b) for a, b in zip(learned["bf16"], truth)) > 1e-5


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The faults page's command stopped by Ctrl-C (SIGINT to the launcher's process group,
    as a terminal sends it) after two epochs, run again, and once through."""
    cwd = tmp_path_factory.mktemp("stop")
    env, run_dir = clean_env(cwd / "home"), cwd / "runs" / "stop"

    def epochs():
        try:
            return len((run_dir / "metrics.jsonl").read_text().splitlines())
        except FileNotFoundError:
            return 0

    proc = start(as_printed(STOP), env, cwd=str(cwd))
    try:
        assert wait_for(lambda: epochs() >= 2, 150), "no epoch 2"
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        rc, out, err = finish(proc, 120)
    first = dict(rc=rc, err=err, finished=(run_dir / "result.json").exists())
    again = run(as_printed(STOP), env, timeout=180, cwd=str(cwd))
    assert again.returncode == 0, again.stderr[-3000:]
    whole = run(as_printed(STOP.replace("runs/stop", "runs/whole")), env, timeout=180, cwd=str(cwd))
    assert whole.returncode == 0, whole.stderr[-3000:]
    return dict(first=first, cwd=cwd, run_dir=run_dir, again=again)


def test_ctrl_c_on_the_faults_pages_command_and_the_same_command_again(stopped):
    first, cwd = stopped["first"], stopped["cwd"]
    # horovodrun dies of the Ctrl-C itself (130 in a shell); the ranks' 75 is not its status
    assert first["rc"] == -signal.SIGINT and not first["finished"], first["err"][-3000:]
    said = [l for l in first["err"].splitlines() if "stopped by SIGTERM at step" in l]
    pattern = (
        re.escape(STOPPED)
        .replace("3000", r"(\d+)")
        .replace(re.escape("/home/me/runs/stop"), re.escape(str(stopped["run_dir"])))
    )
    steps = [int(m.group(1)) for l in said for m in [re.search(pattern + "$", l)] if m]
    assert len(steps) == 1, said  # one line, rank 0's
    assert 2 * 500 <= steps[0] < 40 * 500  # after epoch 2 (500 steps an epoch), before the end
    again, whole = result(stopped["run_dir"]), result(cwd / "runs" / "whole")
    assert again["global_step"] == whole["global_step"] == 40 * 500
    assert again["weights_sha256"] == whole["weights_sha256"] and again["ranks_identical"]
    # the second run trained only from the stop on: its first epoch line is a later epoch
    lines = [l for l in stopped["again"].stdout.splitlines() if "Epoch: " in l]
    assert lines and int(lines[0].split("Epoch: ", 1)[1].split()[0]) > 2, lines[:2]
