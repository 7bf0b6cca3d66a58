"""Configuration: the training settings every task shares, plus the settings each task declares.

``Config`` holds what any run needs (optimisation, data order, distribution, checkpoints,
output) and names no task. A task declares its own settings as a dataclass
(``Task.Settings``: the linear task's synthetic data, the MNIST task's dataset and model) and
its defaults for ``Config`` (``Task.defaults``: the reference programs' learning rates and
worker count).
Every field of both is a command-line flag named after it (``learning_rate`` ->
``--learning-rate``: ``flags.py``); a bad value stops the program before anything is written,
with one line naming the flag and the value.

What a field means for a run is metadata on the field, not a list of names elsewhere:
``defines_run`` (a resume refuses a checkpoint made with another value; on by default for a
task's settings) and ``per_rank`` (may differ between ranks: paths, chattiness; preflight
does not compare it); for a fit script (``hk.fit``), ``fit_refusal`` (why hk.fit does not
take it: the model, its optimizer or the dataset decide it; the reason is the refusal's) and
``fit_name`` (where the script sets it, as the refusals of a resume name it). A field with no
``fit_refusal`` is one of hk.fit's keyword arguments (``fit_refusals``, ``fit_argument``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from hvdtrain.base.errors import ConfigError, EnvError

BACKENDS = ("auto", "horovod", "single")
TRACKERS = ("mlflow", "wandb", "tensorboard")  # --track: see hvdtrain.engine.tracking
PRECISIONS = ("none", "float16", "bfloat16")  # --mixed-precision: see precision.py


def setting(default, help: str, defines_run: bool = True, per_rank: bool = False, **meta):
    """A field of a task's ``Settings`` dataclass: its default, its ``--help`` line.

    Each field of a task's ``Settings`` is a command-line flag named after it (``width:
    int = hvdtrain.setting(64, "hidden units")`` gives ``--width``).

    Args:
        default: the default value (a list or tuple is stored as a tuple).
        help: the flag's line in ``--help``.
        defines_run: a resume refuses a checkpoint made with another value.
        per_rank: the value may differ between ranks (a path, chattiness).
        **meta: more metadata: ``choices=(...)`` limits the values.

    Returns:
        A ``dataclasses.field``.
    """
    meta = dict(help=help, defines_run=defines_run, per_rank=per_rank, **meta)
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    """The training settings of one run, whatever the task.

    Each field is a keyword argument (``Config(learning_rate=0.1, epochs=3)``) and a
    command-line flag (``--learning-rate``); the settings table of the command-line
    reference lists every field with its flag, its default and its meaning. The defaults are
    Keras's own (SGD at 0.01, batches of 32); a task's ``defaults`` replace them (the
    built-in tasks: their learning rates, batch sizes and two workers).
    """

    # Optimisation. Gradients are averaged over workers, as SyncReplicasOptimizer does,
    # so a learning rate means the same at any worker count.
    learning_rate: float = setting(
        0.01,
        "learning rate of the task's optimizer (SGD unless the task chooses its own)",
        fit_refusal="set it on the optimizer given to model.compile",
        fit_name="the optimizer's learning_rate",
    )
    scale_lr: bool = setting(
        False,
        "multiply the learning rate by the world size (Horovod's convention)",
        fit_refusal="scale the optimizer's learning rate by hk.size() in the script",
    )
    momentum: float = setting(
        0.0,
        "momentum of the default SGD optimizer",
        fit_refusal="set it on the optimizer given to model.compile",
        fit_name="the optimizer's momentum",
    )
    epochs: int = setting(10, "passes over the training data", defines_run=False)
    batch_size: int | None = setting(
        32,
        "examples per worker per step; global batch = batch_size * world size; "
        "0 or none: each worker's whole shard per step (full-batch gradient descent)",
        fit_refusal="it is hk.dataset's batch_size",
        fit_name="hk.dataset's batch_size",
    )
    accumulate_steps: int = setting(
        1,
        "gradient accumulation: each optimizer update (a step) averages the gradients of N "
        "micro-batches of batch_size per worker, in one allreduce; global batch per update = "
        "N * batch_size * world size",
        fit_refusal="wrap the optimizer in hk.DistributedOptimizer(optimizer, "
        "backward_passes_per_step=N)",
        fit_name="backward_passes_per_step",
    )
    seed: int = setting(
        1,
        "seed for data order, synthetic data and initialisation (same on every rank)",
        fit_refusal="it is hk.dataset's seed",
        fit_name="hk.dataset's seed",
    )
    mixed_precision: str = setting(
        "none",
        "float16 or bfloat16: build the model under Keras' mixed_<dtype> policy "
        "(16-bit compute, float32 variables, loss and metrics); float16 adds dynamic loss "
        "scaling",
        choices=PRECISIONS,
        fit_refusal="set Keras' policy in the script before building the model "
        "(keras.mixed_precision.set_global_policy('mixed_bfloat16'))",
        fit_name="Keras' dtype policy",
    )
    steps_per_execution: int = setting(
        0,
        "synchronous steps per compiled call (fewer Python and host round trips; SIGTERM, "
        "checkpoints and resume stay on exact steps); 0: auto, calls of about 50 ms, at most "
        "64 steps",
        defines_run=False,
        fit_refusal="set it in model.compile(steps_per_execution=N)",
        fit_name="compile's steps_per_execution",
    )
    # Distribution.
    num_workers: int | None = setting(
        None,
        "worker count the launch scripts start; the launcher's world size wins (a "
        "differing count is warned about)",
        defines_run=False,
        fit_refusal="the launcher decides the world size",
    )
    backend: str = setting(
        "auto",
        "auto: Horovod if importable, else one process; horovod: "
        "require it; single: one process, plain optimizer",
        defines_run=False,
        choices=BACKENDS,
        fit_refusal="hk.init(backend) decides it",
    )
    # Fault tolerance.
    checkpoint_every: int = setting(
        100,
        "rank 0 saves a checkpoint every N synchronous steps "
        "(and at each epoch end); 0: only at epoch ends",
        defines_run=False,
    )
    keep_checkpoints: int = setting(
        3, "how many of the newest checkpoints to keep", defines_run=False
    )
    resume: bool | None = setting(
        None,
        "--resume: continue from the run dir's newest valid "
        "checkpoint (error if none); --no-resume: refuse a run dir "
        "that holds checkpoints; unset: resume when there is one",
        defines_run=False,
    )
    peer_timeout: float = setting(
        30.0,
        "seconds without a heartbeat before a peer counts as "
        "frozen and every rank stops (0 disables the watchdog)",
        defines_run=False,
    )
    elastic: bool = setting(
        False,
        "train under Horovod's elastic driver (horovodrun --min-np/"
        "--max-np --host-discovery-script): workers may leave and join; "
        "needs --run-dir",
        defines_run=False,
        fit_refusal="elastic runs are offered for Task runs only",
    )
    commit_every: int = setting(
        20,
        "elastic: commit the state in memory every N steps (the most work a lost worker costs)",
        defines_run=False,
        fit_refusal="elastic runs are offered for Task runs only",
    )
    stop_on_divergence: bool = setting(
        True,
        "stop with exit 1 when the loss becomes NaN or infinite, keeping the checkpoints "
        "from before it; --no-stop-on-divergence trains on",
        defines_run=False,
    )
    # Output.
    run_dir: str | None = setting(
        None,
        "where rank 0 writes config, metrics, TensorBoard, "
        "checkpoints, the model and the result (none: "
        "runs/<task>-<time>)",
        defines_run=False,
        per_rank=True,
    )
    save_model: bool = setting(
        True, "rank 0 saves the trained model as RUN_DIR/model.keras", defines_run=False
    )
    track: tuple[str, ...] = setting(
        (),
        "experiment trackers rank 0 logs the run to, once per "
        "job, continued on resume: mlflow, wandb, tensorboard "
        "(several allowed)",
        defines_run=False,
    )
    track_required: bool = setting(
        False,
        "a tracker that cannot be reached or fails stops the run (exit 1) instead of a warning",
        defines_run=False,
    )
    verbose: int = setting(
        1,
        "0 silent, 1 progress (rank 0), 2 one line per epoch",
        defines_run=False,
        per_rank=True,
        choices=(0, 1, 2),
    )

    def validate(self) -> Config:
        """Check every field.

        Returns:
            This Config, when every field is good.

        Raises:
            ConfigError: the first bad field, with its flag, its value and why.
        """
        if self.seed < 0:
            raise ConfigError("seed", self.seed, "must be 0 or more")
        for name in ("learning_rate", "epochs"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(name, value, "must be a finite number greater than 0")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError("num_workers", self.num_workers, "must be at least 1")
        for name in ("checkpoint_every", "peer_timeout", "steps_per_execution"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(name, value, "must be 0 or more")
        if self.accumulate_steps < 1:
            raise ConfigError(
                "accumulate_steps", self.accumulate_steps, "must be at least 1 (1: no accumulation)"
            )
        if self.commit_every < 1:
            raise ConfigError("commit_every", self.commit_every, "must be at least 1")
        if self.elastic and not self.run_dir:
            raise ConfigError(
                "elastic",
                True,
                "needs --run-dir (every worker, also one that "
                "joins later, must write to the same run directory)",
            )
        if self.elastic and self.backend == "single":
            raise ConfigError("backend", self.backend, "--elastic needs Horovod")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints", self.keep_checkpoints, "must be at least 1")
        if self.batch_size is not None and self.batch_size < 0:
            raise ConfigError("batch_size", self.batch_size, "must be 0 (full batch) or more")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", self.momentum, "must be in [0, 1)")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(
                "mixed_precision", self.mixed_precision, f"choose one of {', '.join(PRECISIONS)}"
            )
        track = (self.track,) if isinstance(self.track, str) else tuple(self.track or ())
        names = [n.strip().lower() for item in track for n in str(item).split(",") if n.strip()]
        for name in names:
            if name not in TRACKERS:
                raise ConfigError(
                    "track", name, f"unknown tracker; choose from {', '.join(TRACKERS)}"
                )
        self.track = tuple(dict.fromkeys(names))
        if self.backend not in BACKENDS:
            raise ConfigError(
                "backend", self.backend, f"unknown backend; choose one of {', '.join(BACKENDS)}"
            )
        return self

    def to_dict(self) -> dict:
        # Deprecated (nothing calls it; undocumented, so the API pages leave it out): still
        # works, saying what to use.
        import warnings

        warnings.warn(
            "Config.to_dict is deprecated: use dataclasses.asdict(config)",
            DeprecationWarning,
            stacklevel=2,
        )
        return dataclasses.asdict(self)


def env_number(name: str, default: float, valid, advice: str, strip: bool = False) -> float:
    """The number an environment variable gives (``default`` when unset or empty; ``strip``:
    blanks around it ignored), or EnvError ``NAME=value: advice`` when it is not a number or
    ``valid(value)`` is false (never for NaN): the settings read from the environment."""
    raw = os.environ.get(name, "")
    raw = raw.strip() if strip else raw
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = math.nan
    if math.isnan(value) or not valid(value):
        raise EnvError(f"{name}={raw}: {advice}")
    return value


def values(obj, defines_run: bool | None = None, per_rank: bool | None = None) -> dict:
    """A settings dataclass as a dict, optionally only the fields with that metadata."""
    if obj is None:
        return {}
    out = {}
    for f in dataclasses.fields(obj):
        if defines_run is not None and f.metadata.get("defines_run", True) != defines_run:
            continue
        if per_rank is not None and f.metadata.get("per_rank", False) != per_rank:
            continue
        value = getattr(obj, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def fit_refusals() -> dict:
    """{name: why}: Config's fields that hk.fit does not take (their ``fit_refusal``)."""
    return {
        f.name: f.metadata["fit_refusal"]
        for f in dataclasses.fields(Config)
        if "fit_refusal" in f.metadata
    }


def fit_argument(name: str) -> str:
    """A setting as a fit script sets it: where (a Config field's ``fit_name``: the
    optimizer's learning_rate), else hk.fit's keyword argument of that name."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    return fields[name].metadata.get("fit_name", name) if name in fields else name


def validate_settings(settings) -> None:
    """Choices declared on a task's fields, then the task's own ``validate()`` if it has one."""
    for f in dataclasses.fields(settings):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(settings, f.name) not in choices:
            raise ConfigError(
                f.name, getattr(settings, f.name), f"choose one of {', '.join(map(str, choices))}"
            )
    if hasattr(settings, "validate"):
        settings.validate()
