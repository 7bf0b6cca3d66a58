"""Mixed precision on 2 ranks (horovodrun --gloo), both paths: bfloat16 and float16 (CPU
kernels have both) train like float32 with the ranks identical; float16's loss scaling goes
through the distributed optimizer, so a step with overflowing gradients is skipped on every
rank (the weights stay identical) and still counts as a step.

A small MLP on synthetic data; each test bounds its processes' time.
"""

import json
import os
import textwrap

import numpy as np
import pytest

import usercode
from conftest import KERAS2, Lazy, result, run

EPOCHS, STEPS = 3, 16  # 512 examples, 16 per rank: 16 steps an epoch
# Each epoch's mean training loss against the float32 run's, at most (see the tests).
BF16_TOLERANCE, F16_TOLERANCE = 0.01, 0.002
HUGE_SCALE = 2.0**40  # scaled gradients overflow float16 (max 65504) until it halves enough

COMMON = textwrap.dedent("""
    import numpy as np
    from hvdtrain.compat import keras

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(800, 16)).astype("float32")
        y = (x[:, 0] - x[:, 1] + 0.5 * x[:, 2] * x[:, 3] > 0.0).astype("int64")
        return x[:512], y[:512], x[512:], y[512:]

    def model():
        k = keras()
        k.utils.set_random_seed(1)
        return k.Sequential([k.Input((16,)), k.layers.Dense(32, activation="relu"),
                             k.layers.Dense(32, activation="relu"), k.layers.Dense(2)])

    def sgd(learning_rate, initial_scale=0.0):
        opt = keras().optimizers.SGD(learning_rate)
        if initial_scale:
            opt = keras().mixed_precision.LossScaleOptimizer(opt, initial_scale=initial_scale)
        return opt
""")
TASK = textwrap.dedent(
    """
    import dataclasses
    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data
    import common

    @dataclasses.dataclass
    class Settings:
        initial_scale: float = hvdtrain.setting(0.0, "float16: the task's own loss scaler's "
                                                "initial scale (0: hvdtrain's default)")

    class MP(hvdtrain.Task):
        name = "mp"
        Settings = Settings
        defaults = dict(learning_rate=0.1, batch_size=16, epochs=%d, checkpoint_every=0)

        def load_data(self, config, world):
            return Data(*common.data())

        def build_model(self, config):
            return common.model()

        def build_optimizer(self, config, learning_rate):
            return common.sgd(learning_rate, self.settings.initial_scale)

        def loss(self, y, pred):
            return keras().losses.sparse_categorical_crossentropy(y, pred, from_logits=True)

        def metrics(self):
            return {"accuracy": lambda y, p: keras().metrics.sparse_categorical_accuracy(y, p)}
"""
    % EPOCHS
)
# argv: run_dir policy [initial_scale order]. Without an initial scale the script compiles
# hk.DistributedOptimizer(SGD) and lets compile add the loss scaler (outside it); with one,
# order "inside": hk.DistributedOptimizer(LossScaleOptimizer(SGD, initial_scale)),
# "outside": LossScaleOptimizer(hk.DistributedOptimizer(SGD), initial_scale).
FIT = textwrap.dedent(
    """
    import sys
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    import common

    hk.init()
    x, y, x_test, y_test = common.data()
    keras().mixed_precision.set_global_policy(sys.argv[2])
    model = common.model()
    if len(sys.argv) == 5 and sys.argv[4] == "outside":
        optimizer = keras().mixed_precision.LossScaleOptimizer(
            hk.DistributedOptimizer(common.sgd(0.1)), initial_scale=float(sys.argv[3]))
    else:
        optimizer = hk.DistributedOptimizer(
            common.sgd(0.1, float(sys.argv[3]) if len(sys.argv) > 3 else 0.0))
    model.compile(optimizer=optimizer,
                  loss=keras().losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    try:
        hk.fit(model, hk.dataset(x, y, batch_size=16, seed=1), epochs=%d,
               validation_data=(x_test, y_test), run_dir=sys.argv[1], checkpoint_every=0,
               verbose=2)
    except hk.Error as e:
        sys.exit(hk.report_error(e))
"""
    % EPOCHS
)


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    return usercode.write(
        tmp_path_factory.mktemp("mp"), {"common": COMMON, "mp_task": TASK, "mp_fit": FIT}
    )


@pytest.fixture(scope="module")
def overflowing(code, tmp_path_factory):
    """The float16 runs whose scaled gradients overflow (initial scale 2**40, the fit
    script's scaler outside hk.DistributedOptimizer), with a Horovod timeline: one launch per
    path, made when a test first reads it, for the tests that read the same run
    (``overflowing["task"]``: (run_dir, timeline))."""
    base = tmp_path_factory.mktemp("overflowing")

    def launch(path):
        timeline = base / f"{path}.json"
        if path == "task":
            return task(
                code,
                base,
                "task",
                "--mixed-precision",
                "float16",
                "--initial-scale",
                str(HUGE_SCALE),
                HOROVOD_TIMELINE=timeline,
            ), timeline
        return fit(
            code, base, "fit", "mixed_float16", HUGE_SCALE, "outside", HOROVOD_TIMELINE=timeline
        ), timeline

    return Lazy(launch)


def two_ranks(code, tmp_path, *cmd, ok=True, **env):
    p = run(usercode.two_ranks(*cmd), usercode.env_with(code, tmp_path, **env), timeout=240)
    if ok:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def task(code, tmp_path, name, *flags, **env):
    run_dir = str(tmp_path / name)
    two_ranks(
        code, tmp_path, "-m", "hvdtrain", "run", "mp_task:MP", "--run-dir", run_dir, *flags, **env
    )
    return run_dir


def fit(code, tmp_path, name, policy, *args, **env):
    run_dir = str(tmp_path / name)
    two_ranks(code, tmp_path, code / "mp_fit.py", run_dir, policy, *args, **env)
    return run_dir


def losses(run_dir, key="loss"):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def config(run_dir):
    with open(os.path.join(run_dir, "config.json")) as f:
        return json.load(f)


def check_like_float32(run_dir, reference, tolerance):
    """Ranks identical, every step counted, and each epoch's loss within ``tolerance`` of
    the float32 run's, falling as it falls."""
    res, ref = result(run_dir), result(reference)
    assert res["ranks_identical"] is True
    assert res["global_step"] == EPOCHS * STEPS
    got, want = losses(run_dir), losses(reference)
    assert len(got) == len(want) == EPOCHS
    assert np.abs(np.subtract(got, want)).max() <= tolerance, (got, want)
    assert got[-1] < got[0] - 0.1 and want[-1] < want[0] - 0.1, (got, want)
    return res, ref


@pytest.mark.keras2
def test_task_bfloat16_and_float16_train_like_float32_ranks_identical(code, tmp_path):
    ref = task(code, tmp_path, "float32")
    bf16 = task(code, tmp_path, "bf16", "--mixed-precision", "bfloat16")
    f16 = task(code, tmp_path, "f16", "--mixed-precision", "float16")
    # bfloat16 keeps 8 bits of mantissa (float16 11). Measured gaps (Keras 3): bfloat16
    # 1.0e-3, float16 1.7e-4.
    res, base = check_like_float32(bf16, ref, BF16_TOLERANCE)
    assert "loss_scale" not in res and res["weights_sha256"] != base["weights_sha256"]
    assert res["test_accuracy"] == pytest.approx(base["test_accuracy"], abs=0.03)
    res, _ = check_like_float32(f16, ref, F16_TOLERANCE)
    assert res["loss_scale"] == 2.0**15  # Keras' initial scale: no overflow, no growth yet
    assert config(bf16)["mixed_precision"] == "bfloat16"
    assert config(f16)["mixed_precision"] == "float16"


@pytest.mark.keras2
def test_task_float16_overflow_skipped_on_every_rank(code, tmp_path, overflowing):
    """The task's own LossScaleOptimizer starting at 2**40: the first steps' scaled
    gradients overflow float16 on every rank, the reduced gradients are not finite, every
    rank skips the update and halves the scale, until it fits; training then goes on. The
    scale is in the checkpoints: a run resumed from epoch 1's end (still skipping) ends
    with the uninterrupted run's weights and scale."""
    flags = ("--mixed-precision", "float16", "--initial-scale", str(HUGE_SCALE))
    run_dir, _ = overflowing["task"]  # task(code, tmp_path, "huge", *flags), timeline on
    res = result(run_dir)
    assert res["ranks_identical"] is True
    assert res["global_step"] == EPOCHS * STEPS  # skipped steps count
    skipped = 40 - np.log2(res["loss_scale"])  # measured: 23 (Keras 3 and 2)
    assert skipped == int(skipped) and STEPS < skipped < 2 * STEPS, res["loss_scale"]
    got = losses(run_dir)
    assert got[-1] < got[0] - 0.1, got
    cut = task(code, tmp_path, "cut", *flags, "--epochs", "1")
    assert result(cut)["loss_scale"] == 2.0 ** (40 - STEPS)  # every step of epoch 1 skipped
    task(code, tmp_path, "cut", *flags, "--epochs", str(EPOCHS))  # resumes at step 16
    resumed = result(cut)
    assert resumed["global_step"] == EPOCHS * STEPS and resumed["ranks_identical"] is True
    assert resumed["loss_scale"] == res["loss_scale"]
    assert resumed["weights_sha256"] == res["weights_sha256"]


@pytest.mark.keras2
def test_fit_bfloat16_and_float16_policies_train_like_float32_ranks_identical(code, tmp_path):
    """The script sets Keras' policy; for float16 compile wraps hk.DistributedOptimizer in
    a LossScaleOptimizer, which hk.fit turns around (Keras 3) or keeps (Keras 2)."""
    ref = fit(code, tmp_path, "float32", "float32")
    bf16 = fit(code, tmp_path, "bf16", "mixed_bfloat16")
    f16 = fit(code, tmp_path, "f16", "mixed_float16")
    res, base = check_like_float32(bf16, ref, BF16_TOLERANCE)
    assert "loss_scale" not in res
    assert losses(bf16, "val_accuracy")[-1] == pytest.approx(
        losses(ref, "val_accuracy")[-1], abs=0.03
    )
    res, _ = check_like_float32(f16, ref, F16_TOLERANCE)
    assert res["loss_scale"] == 2.0**15
    assert config(bf16)["mixed_precision"] == "bfloat16"
    assert config(f16)["mixed_precision"] == "float16"


@pytest.mark.keras2
@pytest.mark.parametrize("order", ["inside", "outside"])
def test_fit_float16_overflow_skipped_on_every_rank(code, tmp_path, order, overflowing):
    """Either order of LossScaleOptimizer and hk.DistributedOptimizer: the scaler sees the
    reduced gradients (Keras 3: hk.fit turns "outside" around; Keras 2: Horovod's wrapper
    reduces inside the scaler's compute_gradients, and hk.DistributedOptimizer puts itself
    there)."""
    run_dir = (
        overflowing["fit"][0]
        if order == "outside"
        else fit(code, tmp_path, "huge", "mixed_float16", HUGE_SCALE, order)
    )
    res = result(run_dir)
    assert res["ranks_identical"] is True and res["global_step"] == EPOCHS * STEPS
    skipped = 40 - np.log2(res["loss_scale"])
    assert skipped == int(skipped) and 5 <= skipped < 2 * STEPS, res["loss_scale"]
    got = losses(run_dir)
    assert got[-1] < got[0] - 0.1, got


@pytest.mark.keras2
def test_a_bad_precision_is_one_line(code, tmp_path):
    env = usercode.env_with(code, tmp_path)
    p = run(
        [
            *map(
                str,
                [
                    "python",
                    "-m",
                    "hvdtrain",
                    "run",
                    "mp_task:MP",
                    "--mixed-precision",
                    "float8",
                    "--run-dir",
                    tmp_path / "bad",
                ],
            )
        ],
        env,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "python -m hvdtrain run mp_task:MP: error: argument --mixed-precision: invalid "
        "choice: 'float8' (choose from 'none', 'float16', 'bfloat16')"
    ], p.stderr
    assert not os.path.exists(tmp_path / "bad")
    # In code: hvdtrain.train's Config, and hk.fit, where the script's policy decides.
    from hvdtrain import Config
    from hvdtrain.base.errors import ConfigError
    from hvdtrain.fit.script import fit_config

    with pytest.raises(ConfigError) as e:
        Config(mixed_precision="fp16").validate()
    assert str(e.value) == "--mixed-precision=fp16: choose one of none, float16, bfloat16"
    with pytest.raises(ConfigError) as e:
        fit_config(None, None, 1, None, mixed_precision="bfloat16")
    assert str(e.value).startswith(
        "--mixed-precision=bfloat16: not an hk.fit setting: set Keras' policy in the script"
    )


@pytest.mark.keras2
def test_float16_one_negotiation_round_per_step_both_paths(overflowing):
    """Loss scaling adds no collective: a Horovod timeline shows each gradient (6) negotiated
    once per step, overflowing steps included, in the step's one grouped allreduce, with the
    step's flags as a 7th part (the Task path's [stop, diverged]; the fit path's [stop, 1],
    optimizer.StopFlags; Keras 2's fit: Horovod's own wrapper, one fused allreduce per
    gradient and one for the flags, as without mixed precision), and few other rounds: no
    host stop check on either path."""
    import collections

    from hvdtrain.bench.cases import read_timeline

    def per_step(timeline):
        """(names negotiated once per step, negotiations of the others)."""
        events = read_timeline(str(timeline))
        names = {
            e["pid"]: e["args"]["name"]
            for e in events
            if e.get("name") == "process_name" and "name" in e.get("args", {})
        }
        counts = collections.Counter(
            names[e["pid"]]
            for e in events
            if e.get("ph") == "B" and e.get("name") == "NEGOTIATE_ALLREDUCE"
        )
        each = sorted(n for n, c in counts.items() if c == steps)
        return each, sum(c for n, c in counts.items() if n not in each)

    steps = EPOCHS * STEPS
    run_dir, timeline = overflowing["task"]
    assert result(run_dir)["loss_scale"] < HUGE_SCALE  # it did skip steps
    each, others = per_step(timeline)
    assert [n.rsplit("_", 1)[-1] for n in each] == [f"{i}of7" for i in range(1, 8)], each
    # the epochs' metric sums and checkpoints' checks (4 each), the run's start and end (14)
    assert others <= 4 * EPOCHS + 16, others
    run_dir, timeline = overflowing["fit"]
    assert result(run_dir)["loss_scale"] < HUGE_SCALE
    each, others = per_step(timeline)
    # 6 gradients and the flags (Keras 2: Horovod's wrapper's ops, one per tensor)
    assert len(each) == 7, each
    if not KERAS2:
        assert [n.rsplit("_", 1)[-1] for n in each] == [f"{i}of7" for i in range(1, 8)], each
    # The epoch's and the validation's metric sums (the SIGTERM check at an epoch's end
    # among them), the checkpoints' checks, the run's start and end: the stop flag rides in
    # the steps, so no host check every STOP_CHECK_EVERY steps is left.
    assert others <= 4 * EPOCHS + 16, others


@pytest.mark.keras2
def test_float16_loss_scaling_with_backward_passes_is_refused_in_one_line():
    """Loss scaling and hk.DistributedOptimizer's accumulation together are not offered: one
    ConfigError naming backward_passes_per_step (bfloat16 needs no scaler and accumulates)."""
    from hvdtrain.base.errors import ConfigError
    from hvdtrain.compat import keras
    from hvdtrain.distributed.optimizer import DistributedOptimizer

    k = keras()
    scaled = k.mixed_precision.LossScaleOptimizer(k.optimizers.SGD(0.1))
    with pytest.raises(ConfigError, match="backward.passes.per.step=2: not with a LossScale") as e:
        DistributedOptimizer(scaled, backward_passes_per_step=2)
    assert "\n" not in str(e.value)
