"""The migration guide (docs/guides/migrate.md): each before and after script saved from the
page and run as the page prints it, on two processes, each held to a test accuracy on the
page's synthetic data; the hvdtrain scripts' ranks end with identical weights.

The MultiWorkerMirroredStrategy script runs as the page's two TF_CONFIG workers on this
machine under Keras 2 (TF_USE_LEGACY_KERAS=1, as the page's block exports), and once more
as two workers under Keras 3, where its fit fails with the ValueError the page's warning
quotes. One launch per command, shared by the module's tests."""

import json
import os
import re

import pytest

from conftest import Lazy, as_printed, clean_env, run
from docs_pages import block

PAGE = "guides/migrate.md"
SCRIPTS = {  # file name on the page: the block that holds it
    "train_horovod.py": block(
        "guides/migrate.md",
        "import numpy as np\nimport tensorflow as tf\n\nimport horovod.tensorflow.keras as hvd",
    ),
    "train_fit.py": block(
        "guides/migrate.md",
        "import sys\n\nimport hvdtrain.keras as hk  # before TensorFlow: it keeps TensorFlow's start-up lines out\nimport keras\nimport numpy as np\n\nhk.init()  # Horovod;",
    ),
    "tape_horovod.py": block(
        "guides/migrate.md",
        "import numpy as np\nimport tensorflow as tf\n\nimport horovod.tensorflow as hvd",
    ),
    "blobs.py": block("guides/migrate.md", "import hvdtrain\n"),
    "train_mwms.py": block(
        "guides/migrate.md", "import numpy as np\nimport tensorflow as tf\n\n# TF_CONFIG"
    ),
    "train_fit_global.py": block(
        "guides/migrate.md",
        "import sys\n\nimport hvdtrain.keras as hk  # before TensorFlow: it keeps TensorFlow's start-up lines out\nimport keras\nimport numpy as np\n\nhk.init()  # no TF_CONFIG",
    ),
}
FIT_COMMANDS = block("guides/migrate.md", "horovodrun -np 2 python train_horovod.py").commands()
TAPE_COMMANDS = block("guides/migrate.md", "horovodrun -np 2 python tape_horovod.py").commands()
MWMS = block("guides/migrate.md", "export TF_USE_LEGACY_KERAS=1")
GLOBAL_COMMANDS = block(
    "guides/migrate.md", "horovodrun -np 2 python train_fit_global.py"
).commands()
ACCURACY = 0.95  # the page: "a test accuracy above 0.95 on two processes"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("migrate")
    for name, b in SCRIPTS.items():
        assert b.lang == "python", b
        (cwd / name).write_text(b.text)
    return cwd


@pytest.fixture(scope="module")
def launched(folder):
    """{command line as printed: its finished process}, each run the first time it is read."""
    env = clean_env(folder / "home")
    return Lazy(lambda line: run(as_printed(line), env, timeout=240, cwd=str(folder)))


def accuracy(out):
    found = re.findall(r"test accuracy (\d\.\d+)", out)
    assert len(found) >= 1, out[-2000:]
    return [float(a) for a in found]


def result(folder, run_dir):
    with open(folder / run_dir / "result.json") as f:
        return json.load(f)


def test_the_page_runs_each_script_as_it_saves_it():
    commands = FIT_COMMANDS + TAPE_COMMANDS + GLOBAL_COMMANDS
    assert [c.split()[-1] if "--run-dir" not in c else c.split()[4] for c in commands] == [
        "train_horovod.py",
        "train_fit.py",
        "tape_horovod.py",
        "blobs.py",
        "train_fit_global.py",
    ]
    assert all(c.startswith("horovodrun -np 2 python ") for c in commands)
    text = open(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "docs",
            PAGE,
        )
    ).read()
    for name in SCRIPTS:
        assert f"`{name}`" in text, name


def test_horovod_keras_script_and_its_hk_fit_port(launched, folder):
    before, after = (launched[line] for line in FIT_COMMANDS)
    assert before.returncode == 0, before.stderr[-3000:]
    assert after.returncode == 0, after.stderr[-3000:]
    assert min(accuracy(before.stdout)) > ACCURACY and len(accuracy(before.stdout)) == 1
    assert min(accuracy(after.stdout)) > ACCURACY and len(accuracy(after.stdout)) == 1
    r = result(folder, "runs/fit")
    assert r["world_size"] == 2 and r["ranks_identical"] is True
    assert r["global_batch_size"] == 128 and r["global_step"] == 5 * 3072 // 128
    assert r["final_val_accuracy"] > ACCURACY
    assert os.path.exists(folder / "checkpoint-5.keras")  # the before's rank-0 checkpoints


def test_the_line_by_line_table_names_the_scripts_lines():
    """Each row's Horovod code is in the Horovod script, its hvdtrain code in the port."""
    text = open(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "docs",
            PAGE,
        )
    ).read()
    table = text[text.index("| Horovod's line | with hvdtrain |") :]
    table = table[: table.index("\n\n")]
    rows = [r for r in table.splitlines()[2:]]
    assert len(rows) == 9
    before, after = SCRIPTS["train_horovod.py"].text, SCRIPTS["train_fit.py"].text
    for row in rows:
        left, right = row.split(" | ")[:2]
        for code in re.findall(r"`([^`]+)`", left):
            assert code.rstrip(".)").replace("(...)", "(") in before, code
        first = re.findall(r"`([^`]+)`", right)
        if not right.strip().startswith("goes"):
            assert first and first[0] in after, row


def test_gradient_tape_loop_and_its_task(launched, folder):
    before, after = (launched[line] for line in TAPE_COMMANDS)
    assert before.returncode == 0, before.stderr[-3000:]
    assert after.returncode == 0, after.stderr[-3000:]
    assert accuracy(before.stdout) and min(accuracy(before.stdout)) > ACCURACY
    r = result(folder, "runs/blobs")
    assert r["task"] == "blobs" and r["world_size"] == 2 and r["ranks_identical"] is True
    assert r["learning_rate"] == pytest.approx(0.01)  # scale_lr=True: 0.005 * 2
    assert r["global_batch_size"] == 128 and r["test_accuracy"] > ACCURACY


def own_network(script):
    """``script`` under bash in a network namespace of its own (loopback up): the page's fixed
    TF_CONFIG ports cannot meet another process's."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace (unshare --net)")
    return ["unshare", "--net", "bash", "-c", "ip link set lo up\n" + script]


def test_mwms_script_as_two_tf_config_workers(folder):
    """The page's block run by bash as printed: two workers, each prints the same accuracy."""
    env = clean_env(folder / "home")
    env.pop("TF_CONFIG", None)
    p = run(own_network(MWMS.text), env, timeout=240, cwd=str(folder))
    assert p.returncode == 0, p.stderr[-3000:]
    found = accuracy(p.stdout)
    assert len(found) == 2 and min(found) > ACCURACY, p.stdout[-2000:]
    assert p.stdout.count("Epoch 5/5") == 2  # both workers trained all the epochs


def test_mwms_script_under_keras_3_fails_as_the_warning_says(folder):
    lines = [l for l in MWMS.text.splitlines() if l.startswith("TF_CONFIG=")]
    assert len(lines) == 2 and MWMS.text.startswith("export TF_USE_LEGACY_KERAS=1\n")
    env = clean_env(folder / "home")
    env.pop("TF_USE_LEGACY_KERAS", None)
    p = run(own_network("\n".join(lines + ["wait"])), env, timeout=240, cwd=str(folder))
    assert "test accuracy" not in p.stdout  # (bash's `wait` ends 0 whatever the workers did)
    assert (
        "ValueError: Attempt to convert a value (PerReplica:{" in p.stderr
        and "with an unsupported type (<class 'tensorflow.python.distribute.values."
        "PerReplica'>) to a Tensor."
        in p.stderr
    ), p.stderr[-3000:]
    text = open(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "docs",
            PAGE,
        )
    ).read()
    assert (
        "`ValueError: Attempt to convert a value (PerReplica:{...}) with an unsupported type"
        in text
    )


def test_mwms_port_keeps_the_global_batch(launched, folder):
    (after,) = (launched[line] for line in GLOBAL_COMMANDS)
    assert after.returncode == 0, after.stderr[-3000:]
    assert min(accuracy(after.stdout)) > ACCURACY
    r = result(folder, "runs/fit-global")
    assert r["world_size"] == 2 and r["ranks_identical"] is True
    assert r["batch_size"] == 64 and r["global_batch_size"] == 128
    assert r["learning_rate"] == pytest.approx(0.01)  # not scaled: the same global batch
