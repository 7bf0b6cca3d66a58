"""The configuration and its command line: the seeds' numbers, flags, bad input."""
import dataclasses

import pytest

from conftest import module_cmd, run
from hvdtrain.config import Config, ConfigError, build_parser, parse_args, preset


def test_presets_hold_the_seed_numbers():
    lin = preset("linear")
    assert (lin.num_samples, lin.num_features, lin.true_weights, lin.true_bias) == \
        (1000, 3, (0.1, 0.2, 0.3), 0.4)
    assert (lin.learning_rate, lin.epochs, lin.batch_size, lin.num_workers) == (0.5, 10, None, 2)
    mn = preset("mnist")
    assert (mn.learning_rate, mn.batch_size, mn.num_workers, mn.epochs) == (0.001, 100, 2, 10)
    assert not mn.scale_lr and mn.momentum == 0.0


def test_every_field_is_a_flag_and_help_shows_defaults():
    help_text = build_parser("mnist").format_help()
    for f in dataclasses.fields(Config):
        if f.name != "task":
            assert "--" + f.name.replace("_", "-") in help_text
    assert "(default: 0.001)" in help_text and "(default: 100)" in help_text
    assert "(default: 0.5)" in build_parser("linear").format_help()


def test_flags_override_the_preset():
    c = parse_args("linear", ["--learning-rate", "0.1", "--epochs", "3", "--scale-lr",
                              "--true-weights", "1", "2", "3", "--batch-size", "50",
                              "--backend", "single", "--seed", "7", "--num-workers", "4"])
    assert (c.learning_rate, c.epochs, c.scale_lr, c.true_weights, c.batch_size) == \
        (0.1, 3, True, (1.0, 2.0, 3.0), 50)
    assert (c.backend, c.seed, c.num_workers, c.task) == ("single", 7, 4, "linear")


@pytest.mark.parametrize("args, flag, value", [
    (["--learning-rate", "0"], "--learning-rate", "0.0"),
    (["--learning-rate", "-0.5"], "--learning-rate", "-0.5"),
    (["--batch-size", "-1"], "--batch-size", "-1"),
    (["--batch-size", "0"], "--batch-size", "0"),
    (["--epochs", "0"], "--epochs", "0"),
    (["--epochs", "-3"], "--epochs", "-3"),
    (["--dataset", "cifar"], "--dataset", "cifar"),
    (["--backend", "nccl"], "--backend", "nccl"),
    (["--data-dir", "/no/such/dir"], "--data-dir", "/no/such/dir"),
    (["--learning-rate", "fast"], "--learning-rate", "fast"),
])
def test_bad_value_exits_2_naming_flag_and_value(args, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args("mnist", args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and value in err


def test_validate_names_the_field():
    with pytest.raises(ConfigError, match=r"--true-weights=0.1,0.2: needs 3 values"):
        Config(task="linear", true_weights=(0.1, 0.2)).validate()


def test_cli_bad_input_writes_nothing_and_prints_no_traceback(env, tmp_path):
    run_dir = tmp_path / "run"
    for args in (["--learning-rate", "-1"], ["--epochs", "0"], ["--batch-size", "-5"],
                 ["--dataset", "svhn"], ["--data-dir", str(tmp_path / "missing")]):
        p = run(module_cmd("mnist", "--run-dir", str(run_dir), *args), env, timeout=60)
        assert p.returncode == 2, p
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert args[0] in lines[0] and args[1] in lines[0]
        assert not run_dir.exists()


def test_unknown_task(env):
    p = run(["python", "-m", "hvdtrain", "regression"], env, timeout=60)
    assert p.returncode == 2 and "unknown task 'regression'" in p.stderr



def test_readme_documents_every_flag():
    import os
    from conftest import ROOT

    readme = open(os.path.join(ROOT, "README.md")).read()
    for f in dataclasses.fields(Config):
        if f.name != "task":
            assert "`--" + f.name.replace("_", "-") in readme, f.name
