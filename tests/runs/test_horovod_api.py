"""Horovod's own TensorFlow API on the stack hvdtrain ships, under Keras 3 and Keras 2.

A user's unchanged Horovod script (``import horovod.tensorflow as hvd``,
``horovod.tensorflow.keras``) runs on the Horovod that scripts/setup.sh builds and patches
(scripts/patches/python/). One 2-rank launch of tests/horovod_api_probe.py (the MPI
controller: Adasum needs it) exercises each API and records what Horovod returned next to
what it should be (computed from every rank's inputs without the API); each test below
asserts on its part. Then Horovod's two TF2 example
scripts, in examples/, run with ``horovodrun -np 2``. The whole module runs in both passes of
scripts/test.sh (``keras2``), and scripts/test_gpu_build.sh runs it on the GPU build's venv.
"""

import json
import os
import re
import sys

import pytest

from conftest import (
    HOROVODRUN,
    KERAS2,
    ROOT,
    as_printed,
    checkout_like,
    clean_env,
    launch_example,
    run,
)
from docs_pages import block

pytestmark = [pytest.mark.keras2, pytest.mark.timeout(300)]
PROBE = os.path.join(ROOT, "tests", "horovod_api_probe.py")
EXACT = 1e-6  # float32 arithmetic done in another order than Horovod's


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    env = clean_env(out / "home")
    p = run([HOROVODRUN, "-np", "2", "--mpi", sys.executable, PROBE, str(out)], env, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out / "probe.json") as f:
        return json.load(f)


def ok(probe, name):
    """The probe's numbers; a probe that raised fails here with Horovod's traceback, one not
    checked on this build skips."""
    r = probe[name]
    assert "traceback" not in r, f"{name}: {r['error']}\n{r['traceback']}"
    if "skipped" in r:
        pytest.skip(r["skipped"])
    return r


def test_the_probe_runs_the_keras_of_this_pass(probe):
    assert probe["size"] == 2
    assert probe["keras"].startswith("tf_keras" if KERAS2 else "keras")


def test_the_probe_is_a_plain_horovod_script():
    """Nothing of hvdtrain: what it measures is Horovod's API, not hvdtrain's wrappers."""
    source = open(PROBE).read()
    assert not re.search(r"^\s*(import|from)\s+hvdtrain", source, re.M)
    assert "import horovod.tensorflow as hvd" in source


@pytest.mark.quick
def test_distributed_gradient_tape_averages(probe):
    r = ok(probe, "gradient_tape")
    assert r["ranks_differ"] > 0.1  # each rank's own gradient is another
    assert r["err"] < EXACT


def test_distributed_gradient_tape_in_a_tf_function_step(probe):
    r = ok(probe, "gradient_tape_in_function")
    assert r["err"] < EXACT and r["ranks_equal"] == 0.0


def test_partial_distributed_gradient_tape(probe):
    r = ok(probe, "partial_gradient_tape")
    assert r["n_local"] == 2 and r["err"] < EXACT


def test_local_source_keeps_its_own_gradient(probe):
    r = ok(probe, "local_source")
    assert r["err_global"] < EXACT and r["err_local"] < EXACT


def test_sparse_as_dense(probe):
    r = ok(probe, "sparse_as_dense")
    assert r["dense"] is True and r["err"] < EXACT


def test_broadcast_model_and_optimizer_variables(probe):
    r = ok(probe, "broadcast_model_and_optimizer")
    assert r["n_opt_vars"] >= 5  # iterations, (learning rate,) two slots per weight
    assert r["max_spread"] == 0.0


def test_allreduce_and_grouped_allreduce_of_keras_variables(probe):
    r = ok(probe, "allreduce_variables")
    assert r["value"] == 1.5 and r["err"] < EXACT  # ranks hold 1 and 2


def test_sync_batch_normalization_uses_the_global_batch(probe):
    r = ok(probe, "sync_batch_norm")
    assert r["local_differs"] > 0.5  # the ranks' own means are far from the global one
    assert r["err"] < 1e-5 and r["moving_mean_err"] < EXACT


def test_elastic_state_restores_the_committed_weights(probe):
    r = ok(probe, "elastic_keras_state")
    assert r["moved"] > 1e-3  # training after the commit changed the weights
    assert r["err"] == 0.0 and r["epoch"] == 3  # restore: the committed weights, exactly
    assert r["plain"] == [1.0, 2.0]  # TensorFlowState likewise


def test_elastic_sync_of_a_rank_before_its_first_step(probe):
    r = ok(probe, "elastic_sync_before_the_first_step")
    assert r["n_vars"][0] == r["n_vars"][1] >= 4  # weights, iterations, the momentum slots
    assert r["spread"] == 0.0 and (r["batch"], r["epoch"]) == (4, 2)


@pytest.mark.quick
def test_keras_distributed_optimizer_in_fit(probe):
    r = ok(probe, "keras_distributed_optimizer")
    assert r["err"] < EXACT
    assert r["class"] == "SGD"
    if not KERAS2:  # saved as Keras' own SGD: a saved model loads without Horovod
        assert r["module"].startswith("keras.")


def test_keras_distributed_optimizer_compute_and_apply(probe):
    assert ok(probe, "keras_optimizer_apply_gradients")["err"] < EXACT


def test_keras2_legacy_optimizer(probe):
    r = ok(probe, "legacy_optimizer")
    if not KERAS2:
        pytest.skip("Keras 3 has no keras.optimizers.legacy (one line: see the refusals)")
    assert r["err"] < EXACT and r["loaded_legacy"] is True and r["loaded_reduces"] is True


def test_backward_passes_per_step(probe):
    r = ok(probe, "backward_passes")
    assert r["first_moved"] == 0.0 and r["err"] < EXACT


def test_partial_distributed_optimizer(probe):
    r = ok(probe, "partial_distributed_optimizer")
    assert r["err"] < EXACT and r["local_ranks_differ"] > 1e-3


def test_load_model_restores_state_and_reduces(probe):
    r = ok(probe, "load_model")
    assert r["iterations"] == 1 and r["reduced"] is True
    assert r["moved"] > 1e-3 and r["ranks_equal_after"] == 0.0
    assert r["loads_without_horovod"] is (not KERAS2)


def test_broadcast_metric_average_and_warmup_callbacks(probe):
    r = ok(probe, "callbacks")
    assert r["ranks_equal"] == 0.0  # other initial weights on each rank, broadcast
    assert r["metric"] == [0.5] * 4  # the rank number, averaged over ranks 0 and 1
    assert r["lr"] == pytest.approx(r["expected_lr"], rel=1e-6)
    assert r["lr"][:3] == pytest.approx([0.02 * 2 / 3, 0.02 * 5 / 6, 0.02], rel=1e-6)
    assert r["logged_lr"] == pytest.approx(r["lr"], rel=1e-6)


def test_schedule_callback(probe):
    assert ok(probe, "schedule_callback")["lr"] == pytest.approx([0.1, 0.1, 0.05], rel=1e-6)


def test_best_model_checkpoint_keeps_the_best_epoch(probe):
    r = ok(probe, "best_model_checkpoint")
    assert r["err"] == 0.0 and r["best_epoch"] < 5


def test_momentum_correction_says_why_it_is_not_applied(probe):
    r = ok(probe, "momentum_correction")
    assert len(r["warnings"]) == 1 and "momentum_correction" in r["warnings"][0]
    assert "\n" not in r["warnings"][0]
    assert r["lr"] == pytest.approx([0.075, 0.1], rel=1e-6)  # the warm-up still ran
    assert r["momentum_after"] == 0.9


def test_what_keras3_cannot_do_is_one_line(probe):
    r = ok(probe, "refusals")
    assert r["adasum"] == "ValueError: op == Adasum is not supported yet with Keras"
    if not KERAS2:
        assert r["load_model_legacy_opts"].startswith(
            "ValueError: load_model(legacy_opts=True): Keras 3 has no legacy optimizers"
        )
        assert r["accumulation_twice"] == (
            "ValueError: backward_passes_per_step=2, but the SGD optimizer accumulates "
            "gradient_accumulation_steps=3 already: set one of them"
        )
    for line in r.values():
        assert line is not None and "\n" not in line


def test_loss_scaling_reduces_before_the_check(probe):
    r = ok(probe, "loss_scaling")
    if KERAS2:
        pytest.skip("Keras 3's LossScaleOptimizer order (Keras 2's compile order is right)")
    assert r["compile_kept"] == "LossScaleOptimizer" and r["steps"] == 4
    # rank 1's gradient alone is not finite: both ranks skip the step, the scale halves
    assert r["skipped_moved"] == 0.0 and r["scale_halved"] == 0.5 and r["ranks_equal"] == 0.0
    assert r["refused"].startswith(
        "DistributedOptimizer under a mixed_float16 policy: wrap the loss-scale optimizer"
    )


def test_process_sets_static_and_dynamic(probe):
    r = ok(probe, "process_sets")
    assert r["ids"] == {"0": [0, 1], "1": [0], "2": [1]} and r["ids_equal"]
    assert r["members"] == [0] and r["err"] == 0.0  # each set's mean: over its members only
    assert r["set_differs_from_global"] == 5.0 and r["global_err"] < EXACT
    assert r["gathered_rows"] == 1 and r["gathered_err"] == 0.0
    assert r["after_remove"] == {"0": [0, 1], "1": [0]}


def test_keras_distributed_optimizer_on_a_process_set(probe):
    r = ok(probe, "keras_optimizer_on_a_process_set")
    assert r["err"] < EXACT and r["ranks_differ"] > 1e-3  # each rank's own step


def test_join_a_joined_rank_contributes_zeros(probe):
    r = ok(probe, "join")
    own = r["own"]  # rank 0's tensor; rank 1 joined without reducing
    assert r["sum"] == own and r["average"] == [v / 2 for v in own]
    assert r["last_joined"] == [[0], [0]]


def test_alltoall_with_splits(probe):
    r = ok(probe, "alltoall")
    assert r["equal"] == [[True], [True]]
    assert r["received_splits"] == r["expected_splits"] == [[1, 3], [2, 1]]


def test_reducescatter_sum_average_and_grouped(probe):
    r = ok(probe, "reducescatter")
    assert r["err"] < EXACT and r["shape"] == [2, 3]


def test_adasum_against_its_formula_for_two_ranks(probe):
    r = ok(probe, "adasum")
    assert r["err"] < 1e-12 and r["differs_from_mean"] > 0.1
    assert r["orthogonal"] == [1.0, 2.0] and r["equal"] == [3.0, -1.0]


def test_broadcast_global_variables_refused_in_eager_with_the_way_out(probe):
    error = ok(probe, "broadcast_global_variables")["error"]
    assert "does not support eager execution" in error and "broadcast_variables" in error


def printed(script):
    """The arguments of ``horovodrun -np 2 python examples/SCRIPT ...`` as its docstring
    prints it."""
    pattern = rf"^\s*horovodrun -np 2 python examples/{re.escape(script)}(.*)$"
    return (
        re.search(pattern, open(os.path.join(ROOT, "examples", script)).read(), re.M)
        .group(1)
        .split()
    )


def test_gradient_tape_example(tmp_path):
    """examples/horovod_tf2_mnist.py, Horovod's GradientTape example, as printed, 2 ranks."""
    env = clean_env(tmp_path / "home")
    p = run(
        launch_example(2, "horovod_tf2_mnist.py", *printed("horovod_tf2_mnist.py")),
        env,
        timeout=240,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"Step #\d+\tLoss: ([0-9.]+)", p.stdout)]
    assert len(losses) == 2  # steps 0 and 10 of 12 per rank, printed by rank 0 only
    assert losses[0] > 2.0 and losses[1] < losses[0] - 0.3
    assert (tmp_path / "checkpoints" / "ckpt-1.index").exists()  # rank 0's tf.train.Checkpoint


def test_keras_fit_example_with_callbacks(tmp_path):
    """examples/horovod_keras_mnist.py as the Horovod scripts guide prints it, run as printed
    (its docstring prints the same): DistributedOptimizer and Horovod's callbacks in fit."""
    env = clean_env(tmp_path / "home")
    (line,) = block(
        "guides/horovod-scripts.md", "horovodrun -np 2 python examples/horovod_keras_mnist.py"
    ).commands()
    words = as_printed(line)
    assert words[:5] == ["horovodrun", "-np", "2", "python", "examples/horovod_keras_mnist.py"]
    assert words[5:] == printed("horovod_keras_mnist.py")
    p = run(words, env, timeout=240, cwd=checkout_like(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Warm-up to 0.001 * size over 3 epochs, as logged by the callback each epoch.
    lrs = [float(v) for v in re.findall(r" - lr: ([0-9.e-]+)", p.stdout)]
    assert lrs == pytest.approx([0.002 * 2 / 3, 0.002 * 5 / 6, 0.002, 0.002], abs=1e-4)
    assert "Epoch 3: finished gradual learning rate warmup to 0.002." in p.stdout
    accuracy = [float(v) for v in re.findall(r"accuracy: ([0-9.]+)", p.stdout)]
    assert len(accuracy) == 4 and accuracy[-1] > accuracy[0] + 0.2
    files = os.listdir(tmp_path)  # ModelCheckpoint on rank 0, every epoch
    assert all(f"checkpoint-{e}.keras" in files for e in range(1, 5)), files


def test_a_jit_compiled_keras_step_trains_without_xla(probe):
    """jit_compile=True (Keras 3's "auto" with a GPU visible) on Horovod's optimizer: the step
    runs without XLA and applies the mean gradient; one line on rank 0, once per process."""
    r = ok(probe, "jit_compiled_fit")
    assert r["err"] < EXACT and r["ranks_equal"] == 0.0
    assert r["jit_compile"] == [False, False]
    assert len(r["said"]) == 1, r["said"]
    assert "Horovod's ops have no XLA kernels" in r["said"][0]
    # The Horovod scripts guide prints the line as it is.
    assert (
        block("guides/horovod-scripts.md", "horovod: jit_compile turned off").text
        == r["said"][0] + "\n"
    )


def test_a_collective_in_a_users_xla_function_is_refused_in_one_line(probe):
    r = ok(probe, "jit_compiled_user_function")
    for function, op in [("reduce_step", "horovod_allreduce"), ("tape_step", "horovod_allreduce")]:
        error = r["errors"][function]
        assert error is not None, f"{function} ran under XLA"
        assert error["type"] == "ValueError"
        assert error["message"] == (
            f"{op} in {function}, a function compiled with XLA (jit_compile=True): Horovod's "
            f"ops have no XLA kernels; compile {function} with jit_compile=False"
        )
    assert r["plain_sum"] == [3.0, 3.0]
