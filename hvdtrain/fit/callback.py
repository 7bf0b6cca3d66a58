"""The Keras side of the fit path: the callback that hands Keras' events to the driver
(``driver.FitRun``), and Keras 3's compiled calls cut to an epoch's last steps."""

from __future__ import annotations

from typing import Protocol

from hvdtrain.base import compat
from hvdtrain.fit.script import steps_per_execution


class FitEvents(Protocol):
    """What the callback tells the driver (``driver.FitRun``), one method per Keras event."""

    def epoch_begin(self, epoch: int) -> None: ...

    def batch_begin(self) -> None: ...

    def batch_end(self, batch: int, logs) -> None: ...

    def test_begin(self) -> None: ...

    def test_end(self, logs) -> None: ...

    def epoch_end(self, epoch: int, logs) -> None: ...


class Calls:
    """Keras 3's compiled calls of ``steps_per_execution`` N steps: its loop runs N steps
    per call until the input ends, and hk.fit's input runs on into the next epoch, so the
    epoch's last call, when fewer than N steps are left, runs a function compiled for that
    many (traced once per length; Keras 2 cuts that call itself)."""

    def __init__(self, model):
        self.model, self.shorter, self.full = model, {}, None
        self.n = steps_per_execution(model) if compat.is_keras3() else 1

    def input(self, dataset):
        """Keras 3 counts N steps for every call and ends an epoch early when its count
        passes the input's known length: a length it cannot know keeps it from counting."""
        return dataset.filter(lambda *batch: True) if self.n > 1 else dataset

    def begin(self, left: int) -> None:
        if left >= self.n:
            return
        model, self.full = self.model, self.model.train_function
        model.steps_per_execution = left  # read when the function is traced, at its first call
        if left not in self.shorter:
            model.make_train_function(force=True)
            self.shorter[left] = model.train_function
        model.train_function = self.shorter[left]

    def end(self) -> None:
        if self.full is not None:
            self.model.steps_per_execution, self.model.train_function = self.n, self.full
            self.full = None


def keras_callback(keras, run: FitEvents):
    """The Keras callback (of the Keras in use) that hands fit's events to ``run``."""

    class HorovodFit(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            # tf_keras: the batch logs may stay tensors (read only at the epoch's end), so
            # this callback alone does not make Keras copy them to numpy after every call.
            self._supports_tf_logs = True

        def on_epoch_begin(self, epoch, logs=None):
            run.epoch_begin(epoch)

        def on_train_batch_begin(self, batch, logs=None):
            run.batch_begin()

        def on_train_batch_end(self, batch, logs=None):
            run.batch_end(batch, logs)

        def on_test_begin(self, logs=None):
            run.test_begin()

        def on_test_end(self, logs=None):
            run.test_end(logs)

        def on_epoch_end(self, epoch, logs=None):
            run.epoch_end(epoch, logs)

    return HorovodFit()
