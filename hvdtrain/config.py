"""Configuration: one dataclass of training settings, one preset per task, and the CLI.

The presets hold the numbers of the seed documents (``shared/seeds``), which trained with
TF1's ``SyncReplicasOptimizer`` on two workers. Every field is a CLI flag named after it
(``learning_rate`` -> ``--learning-rate``); ``--help`` shows each default. A bad value
stops the program before anything is written, with one line naming the flag and value.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

TASKS = ("linear", "mnist")
DATASETS = ("mnist", "fashion_mnist")
MODELS = ("softmax", "mlp")
BACKENDS = ("auto", "horovod", "single")


class ConfigError(ValueError):
    """A bad setting. ``str()`` is the one-line message shown to the user."""

    def __init__(self, name: str, value, reason: str):
        self.flag = "--" + name.replace("_", "-")
        super().__init__(f"{self.flag}={_show(value)}: {reason}")


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _f(default, help: str, **meta):
    """A field with its CLI help text (the dataclass is the single source of the CLI)."""
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=dict(help=help, **meta))
    return field(default=default, metadata=dict(help=help, **meta))


@dataclass
class Config:
    """All settings of one training run.

    Defaults here are the MNIST task's; ``preset(task)`` applies the linear task's.
    """

    task: str = _f("mnist", f"task to train: {', '.join(TASKS)}", choices=TASKS)
    # Optimisation. Gradients are averaged over workers, as SyncReplicasOptimizer does,
    # so the seeds' learning rates mean the same at any worker count.
    learning_rate: float = _f(0.001, "SGD learning rate (seed MNIST: 0.001, seed linear: 0.5)")
    scale_lr: bool = _f(False, "multiply the learning rate by the world size (Horovod's convention)")
    momentum: float = _f(0.0, "SGD momentum (the seeds use plain SGD: 0)")
    epochs: int = _f(10, "passes over the training data")
    batch_size: Optional[int] = _f(
        100, "examples per worker per step; global batch = batch_size * world size; "
        "0 or unset on the linear task means the worker's whole shard (full-batch GD)")
    seed: int = _f(1, "seed for data order, synthetic data and initialisation (same on every rank)")
    # Distribution.
    num_workers: int = _f(2, "worker count the launch scripts start; the launcher's world size wins")
    backend: str = _f("auto", "auto: Horovod if importable, else one process; horovod: require it; "
                      "single: one process, plain optimizer", choices=BACKENDS)
    # Data and model.
    dataset: str = _f("mnist", f"MNIST-format dataset: {', '.join(DATASETS)}", choices=DATASETS)
    data_dir: Optional[str] = _f(None, "directory with IDX files (train-images-idx3-ubyte.gz, ...) "
                                 "or a Keras mnist.npz / fashion-mnist.npz")
    download: bool = _f(True, "let one process per host download MNIST when no local copy exists")
    model: str = _f("softmax", "MNIST model: softmax (784->10, the seed's) or mlp (784->256->10)",
                    choices=MODELS)
    hidden_units: int = _f(256, "hidden layer width of the mlp model")
    num_samples: int = _f(1000, "linear task: synthetic examples (global, split over workers)")
    num_features: int = _f(3, "linear task: input features")
    true_weights: Tuple[float, ...] = _f((0.1, 0.2, 0.3), "linear task: weights generating y",
                                         nargs="+")
    true_bias: float = _f(0.4, "linear task: bias generating y")
    # Fault tolerance.
    checkpoint_every: int = _f(100, "rank 0 saves a checkpoint every N synchronous steps (and at "
                               "each epoch end); 0: only at epoch ends")
    keep_checkpoints: int = _f(3, "how many of the newest checkpoints to keep")
    resume: Optional[bool] = _f(None, "--resume: continue from the run dir's newest valid "
                                "checkpoint (error if none); --no-resume: refuse a run dir that "
                                "holds checkpoints; unset: resume when there is one")
    peer_timeout: float = _f(30.0, "seconds without a heartbeat before a peer counts as frozen "
                             "and every rank stops (0 disables the watchdog)")
    elastic: bool = _f(False, "train under Horovod's elastic driver (horovodrun --min-np/--max-np "
                       "--host-discovery-script): workers may leave and join; needs --run-dir")
    commit_every: int = _f(20, "elastic: commit the state in memory every N steps (the most "
                           "work a lost worker costs)")
    # Output.
    run_dir: Optional[str] = _f(None, "where rank 0 writes config, metrics, TensorBoard and result "
                                "(default: runs/<task>-<time>)")
    verbose: int = _f(1, "0 silent, 1 progress bar (rank 0), 2 one line per epoch", choices=(0, 1, 2))

    def validate(self) -> "Config":
        """Raise ConfigError for the first bad field; return self when all are good."""
        for name in ("learning_rate", "epochs", "num_workers", "num_samples", "num_features",
                     "hidden_units"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be greater than 0")
        for name in ("checkpoint_every", "peer_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must be 0 or more")
        if self.commit_every < 1:
            raise ConfigError("commit_every", self.commit_every, "must be at least 1")
        if self.elastic and not self.run_dir:
            raise ConfigError("elastic", True, "needs --run-dir (every worker, also one that "
                              "joins later, must write to the same run directory)")
        if self.elastic and self.backend == "single":
            raise ConfigError("backend", self.backend, "--elastic needs Horovod")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints", self.keep_checkpoints, "must be at least 1")
        if self.batch_size is not None and self.batch_size < 0:
            raise ConfigError("batch_size", self.batch_size, "must be greater than 0")
        if self.batch_size == 0 and self.task != "linear":
            raise ConfigError("batch_size", 0, "must be greater than 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", self.momentum, "must be in [0, 1)")
        for name, allowed in (("task", TASKS), ("dataset", DATASETS), ("model", MODELS),
                              ("backend", BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(name, getattr(self, name),
                                  f"unknown {name}; choose one of {', '.join(allowed)}")
        if self.task == "linear" and len(self.true_weights) != self.num_features:
            raise ConfigError("true_weights", self.true_weights,
                              f"needs {self.num_features} values (--num-features)")
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ConfigError("data_dir", self.data_dir, "no such directory")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The seed documents' numbers, per task.
PRESETS = {
    "linear": dict(
        task="linear",
        learning_rate=0.5,  # seed: GradientDescentOptimizer(0.5)
        epochs=10,          # seed: 10 full-batch steps
        batch_size=None,    # full batch: each worker's whole shard, as the seed feeds x_data
        num_workers=2,
    ),
    "mnist": dict(
        task="mnist",
        learning_rate=0.001,  # seed: GradientDescentOptimizer(0.001)
        batch_size=100,       # seed: mnist.train.next_batch(100), per worker
        # The seed loops until stopped; 10 epochs is 3,000 synchronous steps on full MNIST
        # with two workers: enough for the softmax regression to level off at lr 0.5.
        epochs=10,
        num_workers=2,
    ),
}


def preset(task: str, **overrides) -> Config:
    """The task's default configuration, with ``overrides`` applied and validated."""
    if task not in PRESETS:
        raise ConfigError("task", task, f"unknown task; choose one of {', '.join(TASKS)}")
    return Config(**{**PRESETS[task], **overrides}).validate()


# --- command line -------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: --flag=value: reason``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_optional_int(text: str) -> Optional[int]:
    return None if text.lower() in ("none", "") else int(text)


def build_parser(task: str, prog: Optional[str] = None) -> argparse.ArgumentParser:
    defaults = Config(**PRESETS[task])
    parser = _Parser(
        prog=prog or f"python -m hvdtrain.{task}",
        description=f"Train the {task} task with synchronous data-parallel SGD (Horovod).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Config):
        if f.name == "task":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kwargs = dict(default=default, help=f.metadata["help"], dest=f.name)
        if isinstance(default, bool) or f.name == "resume":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "batch_size":
            kwargs["type"] = _parse_optional_int
        elif f.name in ("data_dir", "run_dir"):
            kwargs["type"] = str
        elif f.name == "true_weights":
            kwargs.update(type=float, nargs="+")
        else:
            kwargs["type"] = type(default)
        if "choices" in f.metadata and f.name not in ("backend", "dataset", "model"):
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)
    return parser


def parse_args(task: str, argv: Optional[Sequence[str]] = None) -> Config:
    """Parse the command line of ``python -m hvdtrain.<task>``; exit 2 on a bad value."""
    parser = build_parser(task)
    ns = parser.parse_args(argv)
    values = vars(ns)
    values["true_weights"] = tuple(values["true_weights"])
    try:
        return Config(task=task, **values).validate()
    except ConfigError as e:
        parser.error(str(e))

