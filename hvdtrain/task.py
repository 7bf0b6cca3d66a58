"""The Task interface: what a model is, what its data is, how it is scored.

The training loop (``train.py``) only talks to this interface, so a task is a small class
and a user's own model trains exactly like the built-in ones:

    class MyTask(hvdtrain.Task):
        name = "mine"
        def load_data(self, config, world): return Data(x_train, y_train, x_test, y_test)
        def build_model(self, config): return tf_keras.Sequential([...])
        def loss(self, y, pred): return tf_keras.losses.sparse_categorical_crossentropy(
            y, pred, from_logits=True)

    hvdtrain.train(MyTask(), hvdtrain.Config(learning_rate=0.1, epochs=3))
"""
from __future__ import annotations

from typing import Callable, Dict

from hvdtrain.data import Data


class Task:
    """Base class of every task. Subclasses set ``name`` and implement the three methods
    ``load_data``, ``build_model`` and ``loss``; the rest have sensible defaults."""

    name = "task"
    #: Show a Keras progress bar per epoch on rank 0 (verbose=1). Off for full-batch tasks.
    progress_bar = True

    def load_data(self, config, world) -> Data:
        """Every example of the task, the same arrays on every rank (the loop shards them).

        Raise ``hvdtrain.data.DataError`` for a bad file: all ranks then stop together.
        """
        raise NotImplementedError

    def build_model(self, config):
        """A built tf_keras model (its variables exist), identical in shape on every rank."""
        raise NotImplementedError

    def loss(self, y, pred):
        """Per-example loss, shape [batch]; the loop averages it over the global batch."""
        raise NotImplementedError

    def preprocess(self, x, y):
        """Turn stored examples into model inputs, inside the compiled step (tensors)."""
        return x, y

    def metrics(self) -> Dict[str, Callable]:
        """name -> fn(y, pred) giving per-example values; reported as exact global means."""
        return {}

    def format_epoch(self, record: dict) -> str:
        parts = [f"Epoch {record['epoch']}/{record['epochs']}", f"step {record['global_step']}",
                 f"loss {record['loss']:.6f}"]
        parts += [f"{k} {record[k]:.4f}" for k in self.metrics()]
        parts.append(f"{record['samples_per_sec']:.0f} samples/s")
        return "  ".join(parts)

    def summarize(self, model) -> dict:
        """Task-specific fields for result.json (e.g. the learned weights)."""
        return {}

    def format_result(self, result: dict) -> str:
        """The closing line rank 0 prints."""
        return f"Final loss: {result['final_loss']:.6f}"
