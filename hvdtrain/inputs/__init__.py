"""Inputs: the data every rank trains on, each rank its own part of it.

- ``loaders``: ``Data`` (a Task's arrays), the linear task's synthetic data, and the
  loaders of the bundled and Keras datasets in MNIST format;
- ``batches``: ``TrainBatches``, what a driver reads of its training input;
- ``arrays``: the epoch plans that deal arrays to the ranks, and ``ArrayBatches``
  (``hk.dataset``'s arrays as a rank's batches);
- ``nest``: arrays in dicts, tuples and lists (a model's several inputs) taken apart and back;
- ``sources``: what a ``tf.data`` pipeline reads (its files), and the lines that say how the
  ranks' inputs differ;
- ``sharding``: a pipeline sharded (by file or by batch) and counted, so that every rank
  takes the same steps;
- ``pipeline``: ``Batches``, a user's ``tf.data`` pipeline replayable from any step and
  checked for changes while it runs; the validation pipeline.

May import: ``hvdtrain.base`` only. A rank's collectives come in as a ``World`` argument.
"""
