"""The Task path: a ``Task`` (what a model is, its data, its loss) trained by hvdtrain's own
compiled loop (``hvdtrain.train``, ``python -m hvdtrain run``).

- ``task``: the ``Task`` interface, its checks, and ``load_task`` (``module:Class``);
- ``step``: ``TrainStep``, the compiled synchronous update (input, loss, averaged gradients);
- ``train``: the driver: shard, build, wrap, restore, train in compiled calls, evaluate;
- ``epochs``: its loop: each epoch in compiled calls of several steps, and its record;
- ``linear`` and ``mnist``: the built-in tasks (their commands: ``python -m hvdtrain.linear``,
  ``python -m hvdtrain.mnist``, the faces ``hvdtrain/linear.py`` and ``hvdtrain/mnist.py``).

May import: ``hvdtrain.base``, ``hvdtrain.inputs``, ``hvdtrain.distributed``,
``hvdtrain.engine``. Not ``hvdtrain.fit``: the two drivers stand side by side.
"""
