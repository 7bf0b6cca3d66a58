"""The public surface: hvdtrain.keras holds its public names only, and every name that moved
away from a public module still works, with a DeprecationWarning naming what to use."""

import dataclasses

import pytest

import hvdtrain
import hvdtrain.keras as hk
from hvdtrain.tasks.task import load_task

pytestmark = pytest.mark.quick


def test_hvdtrain_keras_public_names_are_its_all():
    public = sorted(n for n in dir(hk) if not n.startswith("_"))
    assert public == sorted(hk.__all__), set(public) ^ set(hk.__all__)
    assert len(hk.__all__) == 14


@pytest.mark.parametrize(
    "name, new, says",
    [
        ("Dataset", "hvdtrain.inputs.arrays:ArrayBatches", "hvdtrain.inputs.arrays.ArrayBatches"),
        ("EXIT_PREEMPTED", "hvdtrain.base.errors:EXIT_PREEMPTED", "hk.Preempted.status"),
        (
            "STOP_CHECK_EVERY",
            "hvdtrain.fit.driver:STOP_CHECK_EVERY",
            "hvdtrain.fit.driver.STOP_CHECK_EVERY",
        ),
        ("ConfigError", "hvdtrain.base.errors:ConfigError", "hvdtrain.ConfigError"),
        ("DataError", "hvdtrain.base.errors:DataError", "hvdtrain.data.DataError"),
        ("pipeline", "hvdtrain.inputs.pipeline:", "hvdtrain.inputs.pipeline"),
    ],
)
def test_a_name_that_left_hvdtrain_keras_warns_and_works(monkeypatch, name, new, says):
    import importlib

    monkeypatch.setattr(hk, "_warned", set())
    module, _, attribute = new.partition(":")
    expected = importlib.import_module(module)
    expected = getattr(expected, attribute) if attribute else expected
    with pytest.warns(
        DeprecationWarning,
        match=rf"^hvdtrain\.keras\.{name} is deprecated: "
        rf"use {says.replace('.', '[.]')}",
    ):
        assert getattr(hk, name) is expected
    assert name not in hk.__all__
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        hk.nothing


def test_the_built_in_tasks_keep_their_names():
    import hvdtrain.linear
    import hvdtrain.mnist
    from hvdtrain.tasks import linear, mnist

    assert hvdtrain.mnist.MnistTask is mnist.MnistTask
    assert hvdtrain.linear.LinearTask is linear.LinearTask
    assert type(load_task("mnist")) is mnist.MnistTask
    assert type(load_task("hvdtrain.linear:LinearTask")) is linear.LinearTask


def test_config_to_dict_and_describe_settings_warn_and_work():
    config = hvdtrain.Config(epochs=3)
    with pytest.warns(DeprecationWarning, match=r"Config\.to_dict is deprecated"):
        assert config.to_dict() == dataclasses.asdict(config)
    task = load_task("mnist")
    with pytest.warns(DeprecationWarning, match=r"Task\.describe_settings is deprecated"):
        assert task.describe_settings() == dataclasses.asdict(task.settings)
