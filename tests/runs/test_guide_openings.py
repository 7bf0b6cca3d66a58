"""The commands that open the checkpoints and mixed-precision guides
(docs/guides/checkpoints.md, docs/guides/mixed-precision.md), run as printed on two processes
with the real horovodrun, and what the pages say of them: two epochs and then the same run
continued to four end with the weights of one uninterrupted 4-epoch run (a fourth launch,
which is also the float32 run of the mixed-precision command), its metrics.jsonl one line per
epoch; bfloat16 learns the weights to 1e-3 where float32 gets 1e-6, the ranks identical (a
task whose loss takes the model's output as it is: the pre-flight check must give it float32,
as the step does)."""
import json
import os

import pytest

from conftest import as_printed, clean_env, run
from docs_pages import block

RESUME = block("guides/checkpoints.md",
               "horovodrun -np 2 python -m hvdtrain.linear --batch-size 10 --epochs 2").commands()
(BF16,) = block("guides/mixed-precision.md",
                "horovodrun -np 2 python -m hvdtrain.linear --mixed-precision").commands()
# The float32 run: the mixed-precision command at the default precision, 4 epochs, which is
# also the uninterrupted run of the checkpoints page's second command.
FLOAT32 = BF16.replace("--mixed-precision bfloat16 ", "").replace("runs/bf16", "runs/whole")


def read(run_dir, name):
    with open(os.path.join(run_dir, name)) as f:
        return json.load(f) if name.endswith(".json") else [json.loads(l) for l in f if l.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("openings")
    env = clean_env(cwd / "home")
    out = {}
    for name, line in (("first", RESUME[0]), ("continued", RESUME[1]), ("bf16", BF16),
                       ("whole", FLOAT32)):
        p = run(as_printed(line), env, timeout=180, cwd=str(cwd))
        assert p.returncode == 0, (line, p.stderr[-3000:])
        out[name] = p
        if name == "first":  # what the first command left for the second
            out["first_result"] = read(cwd / "runs" / "lin", "result.json")
    out["cwd"] = cwd
    return out


def test_the_checkpoints_pages_commands_continue_one_run(runs):
    assert RESUME[1] == RESUME[0].replace("--epochs 2", "--epochs 4")
    first, cwd = runs["first_result"], runs["cwd"]
    assert (first["global_step"], first["epochs"]) == (100, 2)  # "global step 100"
    continued, whole = read(cwd / "runs" / "lin", "result.json"), read(cwd / "runs" / "whole",
                                                                       "result.json")
    assert continued["global_step"] == whole["global_step"] == 200
    assert continued["weights_sha256"] == whole["weights_sha256"]
    assert continued["ranks_identical"] is True
    epochs = [m["epoch"] for m in read(cwd / "runs" / "lin", "metrics.jsonl")]
    assert epochs == [1, 2, 3, 4]
    # the second command trained only epochs 3 and 4 (the linear task's "Epoch: 3  Step: 150")
    said = [l.split("Epoch: ", 1)[1].split()[:3] for l in runs["continued"].stdout.splitlines()
            if "Epoch: " in l]
    assert said == [["3", "Step:", "150"], ["4", "Step:", "200"]], said


def test_the_mixed_precision_pages_command(runs):
    cwd = runs["cwd"]
    bf16, f32 = read(cwd / "runs" / "bf16", "result.json"), read(cwd / "runs" / "whole",
                                                                 "result.json")
    settings = read(cwd / "runs" / "bf16", "config.json"), read(cwd / "runs" / "whole",
                                                                 "config.json")
    assert [c["mixed_precision"] for c in settings] == ["bfloat16", "none"]
    assert bf16["ranks_identical"] is True and bf16["global_step"] == f32["global_step"] == 200
    truth = [0.1, 0.2, 0.3, 0.4]
    learned = {name: r["weights"] + [r["bias"]] for name, r in (("bf16", bf16), ("f32", f32))}
    assert learned["f32"] == pytest.approx(truth, abs=1e-6)
    assert learned["bf16"] == pytest.approx(truth, abs=1e-3)
    # it did compute in 16 bits: further from the truth than float32, and not by nothing
    assert max(abs(a - b) for a, b in zip(learned["bf16"], truth)) > 1e-5
