"""``TrainBatches``: what a driver reads of its training input, whatever made it.

Two kinds hold it: ``arrays.ArrayBatches`` (a script's arrays, ``hk.dataset``) and
``pipeline.Batches`` (a user's ``tf.data`` pipeline, sharded and counted); ``hk.fit``'s
driver (``hvdtrain.fit``) reads either through this protocol alone, and asks a pipeline's
``Batches`` for more (its files, watched for changes) by its type.
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainBatches(Protocol):
    """This rank's training batches, the same number of steps on every rank.

    Attributes:
        world: the ranks (``hvdtrain.distributed.World``) the batches are dealt over.
        seed: the order's seed (a pipeline's own: 0).
        shuffle: whether the order is shuffled per epoch (a pipeline's own: False).
        steps: the steps of an epoch, on every rank.
        batch_size: the examples of this rank's (largest) batch.
        examples: the examples all ranks train on per epoch, together.
        sample: the first batch's inputs, for a model to be built and checked with.
    """

    world: Any
    seed: int
    shuffle: bool
    steps: int
    batch_size: int
    examples: int
    sample: Any

    def info(self) -> dict:
        """What result.json says of the input (``train_examples``, ...)."""

    def batches(self, first_epoch: int, end_epoch: int, first_step: int = 0):
        """A ``tf.data.Dataset`` of this rank's batches, epochs ``first_epoch`` to
        ``end_epoch - 1``, from step ``first_step`` of the first: the same batches in any
        process, so that a resumed run trains on what the first run would have."""
