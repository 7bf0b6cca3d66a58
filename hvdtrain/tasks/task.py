"""The Task interface: what a model is, what its data is, how it is scored and optimised.

The training loop (``train.py``) only talks to this interface, so a user's own model trains
exactly like the built-in tasks, with the same command line, checkpoints and guarantees:

    @dataclasses.dataclass
    class Settings:                      # the task's own flags (optional)
        width: int = hvdtrain.setting(64, "hidden units")

    class MyTask(hvdtrain.Task):
        name = "mine"
        Settings = Settings
        def load_data(self, config, world): return Data(x_train, y_train, x_test, y_test)
        def build_model(self, config): return keras.Sequential([...self.settings.width...])
        def loss(self, y, pred): return keras.losses.sparse_categorical_crossentropy(
            y, pred, from_logits=True)          # one value per example

    hvdtrain.cli.run(MyTask())           # flags, exit codes, SIGTERM; or:
    hvdtrain.train(MyTask(width=32), hvdtrain.Config(learning_rate=0.1, epochs=3))
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable

from hvdtrain.base.config import Config, ConfigError, validate_settings
from hvdtrain.base.errors import SpecError, TaskError, error_line, user_code, user_frame
from hvdtrain.inputs.loaders import Data

# The built-in tasks, by the name their command is run with (python -m hvdtrain.<name>).
BUILTIN = {"linear": "hvdtrain.tasks.linear:LinearTask", "mnist": "hvdtrain.tasks.mnist:MnistTask"}


class Task:
    """Base class of every task: a model, its data, its loss.

    Subclasses set ``name`` and implement ``load_data``, ``build_model`` and ``loss``;
    everything else has a default. ``hvdtrain.train(task, config)`` trains an instance, and
    ``hvdtrain.cli.run(task)`` gives it the command line (every ``Config`` field and every
    field of ``Settings`` a flag).

    Args:
        settings: an instance of ``Settings``; by default one is made from ``**values``.
        **values: ``Settings`` fields to set, by name (``MyTask(width=32)``).

    Attributes:
        name: names the run directory, the program and the results.
        description: one line for ``--help``.
        Settings: a dataclass of the task's own settings (each field a flag; see
            ``hvdtrain.setting`` for help text and metadata), or None.
        settings: the ``Settings`` instance this task trains with (None without ``Settings``).
        defaults: the task's values for ``Config`` fields (e.g. its learning rate).
        progress_bar: draw a per-epoch progress bar on a terminal (off for full-batch
            tasks).

    Raises:
        TypeError: ``values`` name no ``Settings`` field, or the task declares no
            ``Settings``.
        ConfigError: a setting is not one of its field's ``choices``, or the
            ``Settings``' own ``validate()`` refuses it.
    """

    name = "task"
    description: str | None = None
    Settings = None
    settings = None  # the Settings instance (set by __init__, and by the command line)
    defaults: dict = {}
    progress_bar = True

    def __init__(self, settings=None, **values):
        if self.Settings is None:
            if settings is not None or values:
                raise TypeError(
                    f"{type(self).__name__} declares no Settings; got "
                    f"{sorted(values) or settings!r}"
                )
            self.settings = None
            return
        if settings is None:
            try:
                settings = self.Settings(**values)
            except TypeError as e:  # an unknown name
                raise TypeError(f"{type(self).__name__}: {e}") from None
        validate_settings(settings)
        self.settings = settings

    def config(self, **overrides) -> Config:
        """This task's training configuration.

        Args:
            **overrides: ``Config`` fields to set, by name.

        Returns:
            ``Config`` with the task's ``defaults``, then ``overrides``, validated.

        Raises:
            ConfigError: a value is out of range.
        """
        return Config(**{**self.defaults, **overrides}).validate()

    # --- what every task provides ---------------------------------------------------------
    def load_data(self, config: Config, world) -> Data:
        """Every example of the task, the same on every rank (hvdtrain shards them per rank).

        ``Data``'s arrays may be numpy arrays (held in memory, gathered on the device) or any
        random-access array-like too big for memory, e.g. ``np.load(path, mmap_mode="r")``:
        each rank then reads only its own batches.

        Args:
            config: the run's ``Config``.
            world: this process's place in the job (``hvdtrain.world()``).

        Returns:
            A ``hvdtrain.data.Data`` of the training examples and, optionally, the test
            examples.

        Raises:
            DataError: a data file is missing or bad (``hvdtrain.data.DataError``): all ranks
                then stop together with one line.
        """
        raise NotImplementedError

    def build_model(self, config: Config):
        """The task's Keras model, built, and identical in shape on every rank.

        Build it with the Keras in use: ``hvdtrain.compat.keras()`` (or plain ``import keras``
        unless ``TF_USE_LEGACY_KERAS=1`` is set). Under ``--mixed-precision`` it is called
        with Keras' mixed policy set (16-bit layers, float32 variables); its outputs may be
        16-bit: they are cast to float32 before ``loss`` and the metrics.

        Args:
            config: the run's ``Config``.

        Returns:
            A built Keras model (its variables exist).
        """
        raise NotImplementedError

    def loss(self, y, pred):
        """The loss of each example of a batch.

        hvdtrain averages it over the global batch; the model's regularisation losses
        (``model.losses``) are added to it.

        Args:
            y: the batch's labels, after ``preprocess``.
            pred: the model's outputs for the batch.

        Returns:
            One value per example, shape ``[batch]``. A loss already reduced to one number
            is refused: the global mean needs the parts
            (``keras.losses.sparse_categorical_crossentropy(y, pred)``, not a ``Loss``
            object's mean).
        """
        raise NotImplementedError

    # --- optional -------------------------------------------------------------------------
    def build_optimizer(self, config: Config, learning_rate: float):
        """The task's optimizer: by default SGD with ``--momentum``.

        Any Keras optimizer (a learning-rate schedule too); hvdtrain wraps it so that the
        gradients are averaged over all ranks.

        Args:
            config: the run's ``Config``; ``config.learning_rate`` is ``learning_rate``.
            learning_rate: the run's learning rate: ``--learning-rate``, times the world size
                with ``--scale-lr``.

        Returns:
            A Keras optimizer of the Keras in use.
        """
        from hvdtrain.base.compat import keras

        return keras().optimizers.SGD(learning_rate=learning_rate, momentum=config.momentum)

    def preprocess(self, x, y):
        """Turn stored examples into model inputs, inside the compiled step.

        Args:
            x: a batch of stored inputs (tensors).
            y: their labels (tensors).

        Returns:
            ``(x, y)`` as the model and ``loss`` take them; by default unchanged.
        """
        return x, y

    def metrics(self) -> dict[str, Callable]:
        """The task's metrics, reported as exact means over every rank's examples.

        Returns:
            ``{name: fn(y, pred)}``, each function giving one value per example (as ``loss``
            does); by default none.
        """
        return {}

    def format_epoch(self, record: dict) -> str:
        """The line rank 0 prints at the end of an epoch when it draws no progress bar.

        Args:
            record: the epoch's numbers (``epoch``, ``epochs``, ``global_step``, ``loss``,
                each metric by its name, ``samples_per_sec``, ...).

        Returns:
            One line.
        """
        parts = [
            f"Epoch {record['epoch']}/{record['epochs']}",
            f"step {record['global_step']}",
            f"loss {record['loss']:.6f}",
        ]
        parts += [f"{k} {record[k]:.4f}" for k in self.metrics()]
        parts.append(f"{record['samples_per_sec']:.0f} samples/s")
        return "  ".join(parts)

    def summarize(self, model) -> dict:
        """Task-specific fields for result.json.

        Args:
            model: the trained model.

        Returns:
            A dict of JSON values (e.g. the learned weights); by default empty.
        """
        return {}

    def format_result(self, result: dict) -> str:
        """The closing line rank 0 prints.

        Args:
            result: what result.json holds (``final_loss``, the metrics, ...).

        Returns:
            One line; by default the final loss.
        """
        return f"Final loss: {result['final_loss']:.6f}"

    def describe_settings(self) -> dict:
        # Deprecated (nothing calls it; undocumented, so the API pages leave it out): still
        # works, saying what to use.
        import warnings

        warnings.warn(
            "Task.describe_settings is deprecated: use dataclasses.asdict(task.settings)",
            DeprecationWarning,
            stacklevel=2,
        )
        return {} if self.settings is None else dataclasses.asdict(self.settings)


def check_loss_shape(task: Task, per_example, batch: int) -> None:
    """Refuse a loss that is not one value per example (a reduced mean would silently make
    every rank's sums, and so the reported metrics, wrong)."""
    shape = tuple(per_example.shape)
    if shape != (batch,):
        raise TaskError(
            f"{type(task).__name__}.loss returned shape {list(shape)} for a batch of {batch}: "
            "it must return one value per example (e.g. reduction='none', or "
            "keras.losses.<name>(y, pred) rather than a Loss object's mean)"
        )


REQUIRED = ("load_data", "build_model", "loss")


def check_task(task: Task) -> None:
    """The methods every task must implement."""
    missing = [m for m in REQUIRED if getattr(type(task), m) is getattr(Task, m)]
    if missing:
        raise TaskError(
            f"{type(task).__name__} does not implement {', '.join(missing)} "
            f"(every Task implements {', '.join(REQUIRED)}; see hvdtrain/tasks/task.py)"
        )


def _array_problem(name: str, a) -> str | None:
    if isinstance(a, (list, tuple)):
        return f"{name} is a {type(a).__name__}: give a numpy array (np.asarray(...))"
    if not (hasattr(a, "shape") and hasattr(a, "__len__") and hasattr(a, "dtype")):
        return f"{name} is a {type(a).__name__}, not an array"
    if len(a.shape) < 1:
        return f"{name} is a scalar, not an array of examples"
    return None


def check_data(task: Task, data) -> None:
    """What ``load_data`` returned: a ``Data`` of arrays, each x as long as its y."""
    where = f"{type(task).__name__}.load_data"
    if not isinstance(data, Data):
        raise TaskError(
            f"{where} returned {type(data).__name__}, not hvdtrain.data.Data("
            "x_train, y_train, x_test, y_test)"
        )
    pairs = [("x_train", "y_train")]
    if data.x_test is not None or data.y_test is not None:
        pairs.append(("x_test", "y_test"))
    for xn, yn in list(pairs):  # a tf.data pipeline of (x, y) examples in place of x, y None
        x, y = getattr(data, xn), getattr(data, yn)
        if hasattr(x, "element_spec"):
            pairs.remove((xn, yn))
            if y is not None or not (
                isinstance(x.element_spec, tuple) and len(x.element_spec) == 2
            ):
                raise TaskError(
                    f"{where}: {xn} is a tf.data.Dataset: its elements must be "
                    f"(x, y) examples, unbatched, and {yn} None"
                )
    for xn, yn in pairs:
        x, y = getattr(data, xn), getattr(data, yn)
        problem = _array_problem(xn, x) or _array_problem(yn, y)
        if problem is None and len(x) != len(y):
            problem = f"{xn} has {len(x)} examples but {yn} has {len(y)}"
        if problem is None and len(x) == 0:  # found now, not after every epoch trained
            problem = (
                f"{xn} has no examples"
                if xn == "x_train"
                else "x_test and y_test have no examples: give a test set, or None for none"
            )
        if problem:
            raise TaskError(f"{where}: {problem}")


def check_optimizer(task: Task, optimizer):
    """What ``build_optimizer`` returned: an optimizer of the Keras in use."""
    from hvdtrain.base.compat import keras

    if not (hasattr(optimizer, "apply_gradients") and hasattr(optimizer, "iterations")):
        raise TaskError(
            f"{type(task).__name__}.build_optimizer returned "
            f"{type(optimizer).__name__} {optimizer!r:.40}, not an optimizer "
            f"(e.g. {keras().__name__}.optimizers.SGD(learning_rate))"
        )
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps and steps > 1:  # it would reduce every micro-batch: the loop accumulates instead
        raise TaskError(
            f"{type(task).__name__}.build_optimizer returned an optimizer with "
            f"gradient_accumulation_steps={steps}: use --accumulate-steps {steps}"
        )
    return optimizer


def check_metrics(task: Task, metrics) -> dict:
    """What ``metrics()`` returned: a dict of name -> per-example function."""
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and callable(f) for k, f in metrics.items()
    ):
        raise TaskError(
            f"{type(task).__name__}.metrics returned {type(metrics).__name__}; it "
            "must return a dict of name -> fn(y, pred) (one value per example)"
        )
    if "loss" in metrics:
        raise TaskError(f"{type(task).__name__}.metrics: 'loss' is the loss's name")
    return metrics


def check_metric_shape(task: Task, name: str, values, batch: int) -> None:
    """A metric gives one value per example, like the loss (see check_loss_shape)."""
    shape = tuple(values.shape)
    if shape != (batch,):
        raise TaskError(
            f"{type(task).__name__}.metrics()[{name!r}] returned shape {list(shape)} for a "
            f"batch of {batch}: it must return one value per example (are y and the "
            "predictions shaped alike?)"
        )


def load_task(spec: str) -> Task:
    """An instance of the Task named ``spec``: a built-in name or ``package.module:Class``."""
    spec = BUILTIN.get(spec, spec)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SpecError(
            f"{spec!r}: name a task as package.module:TaskClass (or one of {', '.join(BUILTIN)})"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        hint = ""
        if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
            hint = (
                f"; KERAS_BACKEND={os.environ['KERAS_BACKEND']} is set, and hvdtrain "
                "trains with TensorFlow: unset it"
            )
        raise SpecError(f"{spec!r}: cannot import {module_name} ({e}){hint}") from None
    except Exception as e:  # noqa: BLE001 (the module's own: a SyntaxError, an error at import)
        raise SpecError(
            f"{spec!r}: importing {module_name} raised {error_line(e)}{user_frame(e)}"
        ) from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise SpecError(f"{spec!r}: {module_name} has no Task subclass named {attr}")
    try:
        with user_code(f"{attr}()"):
            return cls()
    except ConfigError as e:  # a Settings default outside its choices
        raise TaskError(f"{attr}.Settings' default {e}") from None


__all__ = [
    "BUILTIN",
    "Task",
    "TaskError",
    "ConfigError",
    "check_data",
    "check_loss_shape",
    "check_metrics",
    "check_optimizer",
    "check_task",
    "load_task",
]
