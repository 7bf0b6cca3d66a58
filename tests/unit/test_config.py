"""The configuration and its command line: the seeds' numbers, each task's own flags, bad
input, and the metadata that says what a setting means for a run."""

import dataclasses
import os

import pytest

import hvdtrain
from conftest import module_cmd, run
from hvdtrain.base.config import Config, ConfigError, values
from hvdtrain.base.flags import build_parser, parse_args
from hvdtrain.tasks.linear import LinearSettings, LinearTask
from hvdtrain.tasks.mnist import MnistSettings, MnistTask

# Settings, flags and their errors: in this process or a short one; the inner loop runs them.
pytestmark = pytest.mark.quick


def test_presets_hold_the_seed_numbers():
    lin = LinearTask()
    assert (
        lin.settings.num_samples,
        lin.settings.num_features,
        lin.settings.true_weights,
        lin.settings.true_bias,
    ) == (1000, 3, (0.1, 0.2, 0.3), 0.4)
    c = hvdtrain.preset("linear")
    assert (c.learning_rate, c.epochs, c.batch_size, c.num_workers) == (0.5, 10, None, 2)
    mn = hvdtrain.preset("mnist")
    assert (mn.learning_rate, mn.batch_size, mn.num_workers, mn.epochs) == (0.001, 100, 2, 10)
    assert not mn.scale_lr and mn.momentum == 0.0
    assert MnistTask().settings.model == "softmax"


def test_the_generic_config_names_no_task():
    """No task's settings, names or worker count in the training config."""
    names = {f.name for f in dataclasses.fields(Config)}
    assert not names & {f.name for f in dataclasses.fields(LinearSettings)}
    assert not names & {f.name for f in dataclasses.fields(MnistSettings)}
    assert "task" not in names and Config().num_workers is None


def test_help_shows_only_the_tasks_own_flags_with_defaults_and_choices():
    mnist = build_parser(MnistTask()).format_help()
    linear = build_parser(LinearTask()).format_help()
    for f in dataclasses.fields(Config):  # the training flags: every task has them
        flag = "--" + f.name.replace("_", "-")
        assert flag in mnist and flag in linear
    assert "--model {softmax,mlp}" in mnist and "--dataset {mnist,fashion_mnist}" in mnist
    assert "--true-weights" not in mnist and "--model" not in linear
    assert "(default: 0.001)" in mnist and "(default: 0.5)" in linear
    assert "linear task:" in linear and "mnist task:" in mnist


def test_flags_set_the_config_and_the_tasks_settings():
    task = LinearTask()
    c = parse_args(
        task,
        [
            "--learning-rate",
            "0.1",
            "--epochs",
            "3",
            "--scale-lr",
            "--true-weights",
            "1",
            "2",
            "3",
            "--batch-size",
            "50",
            "--backend",
            "single",
            "--seed",
            "7",
            "--num-workers",
            "4",
        ],
    )
    assert (c.learning_rate, c.epochs, c.scale_lr, c.batch_size) == (0.1, 3, True, 50)
    assert (c.backend, c.seed, c.num_workers) == ("single", 7, 4)
    assert task.settings.true_weights == (1.0, 2.0, 3.0)


def test_field_metadata_decides_resume_and_preflight():
    c = Config(run_dir="/x", verbose=0, epochs=5)
    defining = values(c, defines_run=True)
    assert "learning_rate" in defining and "batch_size" in defining
    assert "epochs" not in defining and "run_dir" not in defining  # epochs may grow
    assert set(values(c, per_rank=True)) == {"run_dir", "verbose"}
    s = MnistSettings()
    assert set(values(s, per_rank=True)) == {"data_dir", "download"}
    assert "model" in values(s, defines_run=True)


@pytest.mark.parametrize(
    "args, flag, value",
    [
        (["--learning-rate", "0"], "--learning-rate", "0.0"),
        (["--learning-rate", "-0.5"], "--learning-rate", "-0.5"),
        (["--learning-rate", "1e999"], "--learning-rate", "1e999"),  # finite as text, inf as float
        (["--learning-rate", "nan"], "--learning-rate", "nan"),
        (["--batch-size", "-1"], "--batch-size", "-1"),
        (["--epochs", "0"], "--epochs", "0"),
        (["--epochs", "-3"], "--epochs", "-3"),
        (["--dataset", "cifar"], "--dataset", "cifar"),
        (["--backend", "nccl"], "--backend", "nccl"),
        (["--data-dir", "/no/such/dir"], "--data-dir", "/no/such/dir"),
        (["--learning-rate", "fast"], "--learning-rate", "fast"),
        (["--hidden-units", "0"], "--hidden-units", "0"),
        (["--track", "mlflow", "comet"], "--track", "comet"),
    ],
)
def test_bad_value_exits_2_naming_flag_and_value(args, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(MnistTask(), args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and value in err


def test_validate_names_the_field():
    with pytest.raises(ConfigError, match=r"--true-weights=0.1,0.2: needs 3 values"):
        LinearTask(true_weights=(0.1, 0.2))
    with pytest.raises(ConfigError, match=r"--momentum=1.5: must be in \[0, 1\)"):
        Config(momentum=1.5).validate()


def test_cli_bad_input_writes_nothing_and_prints_no_traceback(env, tmp_path):
    run_dir = tmp_path / "run"
    for args in (
        ["--learning-rate", "-1"],
        ["--epochs", "0"],
        ["--batch-size", "-5"],
        ["--dataset", "svhn"],
        ["--data-dir", str(tmp_path / "missing")],
    ):
        p = run(module_cmd("mnist", "--run-dir", str(run_dir), *args), env, timeout=60)
        assert p.returncode == 2, p
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert args[0] in lines[0] and args[1] in lines[0]
        assert not run_dir.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["regression"], "unknown command 'regression'"),
        (["run", "nomodule"], "name a task as package.module:TaskClass"),
        (["run", "no_such_module:Task"], "cannot import no_such_module"),
        (["run", "hvdtrain.linear:Nothing"], "hvdtrain.linear has no Task subclass named Nothing"),
    ],
)
def test_unknown_task(env, argv, message):
    p = run(["python", "-m", "hvdtrain", *argv], env, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_readme_documents_every_flag():
    from docs_pages import docs_text

    readme = docs_text("reference/cli.md")  # its tables are generated from the fields
    for cls in (Config, LinearSettings, MnistSettings):
        for f in dataclasses.fields(cls):
            assert "`--" + f.name.replace("_", "-") in readme, f.name


def test_sparse_gradients_go_gathered_or_dense_by_one_ratio(monkeypatch):
    """HVDTRAIN_SPARSE_AS_DENSE_RATIO: a number from 0 up (default 1), anything else one line
    naming it; a sparse gradient is gathered when size x its rows < ratio x the table's rows,
    and when its rows are unknown or the world elastic, unless the ratio is 0."""
    from hvdtrain.base.errors import EnvError
    from hvdtrain.distributed.sparse import gathers, ratio

    monkeypatch.delenv("HVDTRAIN_SPARSE_AS_DENSE_RATIO", raising=False)
    assert ratio() == 1.0
    for raw, value in (("0", 0.0), ("0.5", 0.5), ("inf", float("inf"))):
        monkeypatch.setenv("HVDTRAIN_SPARSE_AS_DENSE_RATIO", raw)
        assert ratio() == value
    for raw in ("-1", "nan", "half"):
        monkeypatch.setenv("HVDTRAIN_SPARSE_AS_DENSE_RATIO", raw)
        with pytest.raises(
            EnvError,
            match=rf"^HVDTRAIN_SPARSE_AS_DENSE_RATIO={raw}: give a "
            "number, 0 or more",
        ):
            ratio()
    assert gathers(128, 1_000_000, 2, 1.0) and not gathers(96, 20, 2, 1.0)
    assert not gathers(10, 20, 2, 1.0) and gathers(10, 20, 2, 1.01)  # the rule is strict
    assert gathers(None, 20, 2, 1.0) and gathers(96, 20, 2, 1.0, elastic=True)
    assert not gathers(None, 20, 2, 0.0) and not gathers(1, 10**6, 2, 0.0, elastic=True)
    assert gathers(10**6, 10, 64, float("inf"))


def test_track_takes_several_trackers_in_one_or_more_words():
    c = parse_args(MnistTask(), ["--track", "mlflow,WandB", "tensorboard", "mlflow"])
    assert c.track == ("mlflow", "wandb", "tensorboard") and c.track_required is False
    assert Config(track="wandb").validate().track == ("wandb",)  # hk.fit(track="wandb")
    assert Config().validate().track == ()


def test_the_trackers_callbacks_and_on_chief_run_on_rank_0_only():
    from wandb.integration.keras import WandbMetricsLogger

    from hvdtrain.fit.chief import OnChief, chief_only, on_chief

    logger = object.__new__(WandbMetricsLogger)  # its __init__ wants a live wandb run
    assert isinstance(chief_only(logger), OnChief) and chief_only(logger).callback is logger
    wrapped = on_chief(logger, timeout=None)
    assert chief_only(wrapped) is wrapped and wrapped.timeout is None
    assert chief_only(object()) is None
    with pytest.raises(ValueError, match=r"hk.on_chief\(timeout=0\): must be more than 0"):
        on_chief(logger, timeout=0)


def test_run_dir_prints_the_run_directory_the_flags_name(tmp_path, capsys, monkeypatch):
    """`python -m hvdtrain run-dir`: the last --run-dir, absolute, as training reads it;
    nothing without one; with --job, a batch job's runs/JOB-TASK; the task never loaded."""
    from hvdtrain.__main__ import main

    def said(*argv):
        status = main(["run-dir", *argv])
        out, err = capsys.readouterr()
        return status, out, err

    monkeypatch.chdir(tmp_path)
    assert said("pkg.mod:Missing", "--run-dir", "a", "--epochs", "-1", "--run-dir=b") == (
        0,
        f"{tmp_path}/b\n",
        "",
    )
    assert said("mnist", "--epochs", "2") == (0, "", "")
    assert said("mnist", "--run-dir", "none") == (0, "", "")  # none: the run's own default
    assert said("--job", "exp", "pkg.mod:My Task", "--epochs", "2") == (
        0,
        f"{tmp_path}/runs/exp-pkg.mod_My_Task\n",
        "",
    )
    assert said("--job=exp", "linear", "--run-dir", "/data/r") == (0, "/data/r\n", "")
    with pytest.raises(SystemExit) as e:
        said("mnist", "--run-dir")
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    status, out, err = said("--job", "exp")
    assert status == 2 and out == "" and err.count("\n") == 1 and "needs a task" in err


def test_the_run_directory_names_every_file_of_its_layout(tmp_path, monkeypatch):
    """RunDir: one absolute path, and the paths of what the run directory page lists."""
    from hvdtrain.distributed import World
    from hvdtrain.engine.rundir import RunDir

    run = RunDir.resolve(str(tmp_path / "r"), "t", World())
    assert run == RunDir(tmp_path / "r") and str(run) == f"{tmp_path}/r"
    names = {
        "config": "config.json",
        "metrics": "metrics.jsonl",
        "result": "result.json",
        "checkpoints": "checkpoints",
        "tensorboard": "tensorboard",
        "model": "model.keras",
        "model_weights": "model.weights.h5",
        "tracking": "tracking.json",
        "lock_file": ".lock",
    }
    assert {k: getattr(run, k) for k in names} == {k: f"{tmp_path}/r/{v}" for k, v in names.items()}
    page = open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "reference", "run-directory.md")
    ).read()
    assert all(f"`{v}" in page for v in names.values())
    monkeypatch.chdir(tmp_path)
    default = RunDir.resolve(None, "t", World())
    assert os.path.dirname(default.path) == f"{tmp_path}/runs"
    assert os.path.basename(default.path).startswith("t-")


def test_an_epoch_record_is_the_same_line_as_a_dict():
    """EpochRecord: the keys of metrics.jsonl's lines, in their order, and back."""
    from hvdtrain.engine.report import EpochRecord

    record = EpochRecord(
        epoch=2,
        epochs=3,
        global_step=20,
        metrics={"loss": 0.5, "accuracy": 0.75},
        samples_per_sec=100.0,
        seconds=1.5,
        world_size=2,
    )
    line = record.as_dict()
    assert list(line) == [
        "epoch",
        "epochs",
        "global_step",
        "loss",
        "accuracy",
        "samples_per_sec",
        "seconds",
        "world_size",
    ]
    assert EpochRecord.from_dict(line) == record
    record.input_wait = 0.25
    assert record.as_dict()["input_wait"] == 0.25
    assert EpochRecord.from_dict(record.as_dict()).metrics == {"loss": 0.5, "accuracy": 0.75}
