"""The hyperparameters guide (docs/guides/hyperparameters.md): its two commands run as
printed on two processes; the printed first line and result.json say the per-process batch,
the global batch and the scaled learning rate the page states; the warm-up Task trains and
its schedule starts at one process's rate and reaches the scaled one after two epochs."""

import importlib.util
import json

import pytest

from conftest import as_printed, clean_env, run
from docs_pages import block

PAGE = "guides/hyperparameters.md"
(LINEAR,) = block(
    "guides/hyperparameters.md", "horovodrun -np 2 python -m hvdtrain.linear"
).commands()
FIRST_LINE = block("guides/hyperparameters.md", "hvdtrain: linear on 2 processes").text.strip()
WARMUP = block("guides/hyperparameters.md", "import hvdtrain\n")
(WARMUP_RUN,) = block("guides/hyperparameters.md", "horovodrun -np 2 python warmup.py").commands()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("hyperparameters")
    (cwd / "warmup.py").write_text(WARMUP.text)
    return cwd


def result(path):
    with open(path / "result.json") as f:
        return json.load(f)


def test_the_global_batch_and_the_scaled_learning_rate(folder):
    p = run(as_printed(LINEAR), clean_env(folder / "home"), timeout=180, cwd=str(folder))
    assert p.returncode == 0, p.stderr[-3000:]
    first = [
        l.split(":", 1)[1] if l.startswith("[") else l
        for l in p.stdout.splitlines()
        if "hvdtrain: linear on" in l
    ]
    # The page shows the run directory as it is printed, absolute: under /home/me.
    assert [l.replace(str(folder), "/home/me") for l in first] == [FIRST_LINE], first
    r = result(folder / "runs" / "hp")
    assert (r["batch_size"], r["global_batch_size"], r["learning_rate"]) == (5, 20, 0.1)
    assert r["train_examples"] == 1000 and r["global_step"] == 2 * 50 and r["world_size"] == 2


def test_the_warm_up_task_trains_on_two_processes(folder):
    p = run(as_printed(WARMUP_RUN), clean_env(folder / "home"), timeout=180, cwd=str(folder))
    assert p.returncode == 0, p.stderr[-3000:]
    r = result(folder / "runs" / "warmup")
    assert r["task"] == "warmup" and r["world_size"] == 2 and r["ranks_identical"] is True
    assert r["learning_rate"] == pytest.approx(0.01) and r["global_batch_size"] == 128
    assert r["global_step"] == 6 * 24 and r["test_accuracy"] > 0.95


def test_the_warm_up_schedule_is_the_pages(folder, monkeypatch):
    """The page: 0.005 at step 0, 0.01 after 2 epochs (48 steps of 128), 0 at the end."""
    import hvdtrain
    from hvdtrain.base.config import Config

    spec = importlib.util.spec_from_file_location("warmup_page", folder / "warmup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Two:
        rank, size = 0, 2

    monkeypatch.setattr(hvdtrain, "world", lambda: Two())
    opt = module.Warmup().build_optimizer(Config(epochs=6, batch_size=64), 0.01)
    rates = {}
    for step in (0, 24, 48, 144):
        opt.iterations.assign(step)
        rates[step] = float(opt.learning_rate)
    assert rates == pytest.approx({0: 0.005, 24: 0.0075, 48: 0.01, 144: 0.0}, abs=1e-7)
