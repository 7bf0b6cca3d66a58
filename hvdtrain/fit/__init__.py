"""The fit path: a ``model.compile`` / ``model.fit`` script over the run engine
(``hvdtrain.keras.fit``, ``hk.fit``, calls it).

- ``script``: what a fit script gives (the compiled model, its optimizers, the callbacks,
  the validation data, the settings), checked, and the run's ``Config`` made from it;
- ``metrics``: the epoch and validation metrics made exact over all ranks;
- ``driver``: ``FitRun``, one ``hk.fit`` on this rank: restore, broadcast, ``model.fit``,
  checkpoints and stops at the same step on every rank, the result;
- ``steps``: where the driver stands in its steps (``FitCounters``), SIGTERM on any rank
  checked (``StopCheck``), and the call boundaries that pass a multiple of steps;
- ``callback``: the Keras side: the callback that hands Keras' events to the driver, and
  Keras 3's compiled calls cut to an epoch's last steps;
- ``chief``: callbacks that run on rank 0 only (``hk.on_chief``, the trackers' own), each
  call bounded in time.
- ``entry``: one ``hk.fit`` call put together: its input, its ``Config``, the ``Run``, the
  ``FitRun``;
- ``adapt``: ``hk.adapt``'s work: a preprocessing layer adapted on rank 0, its state on
  every rank.

May import: ``hvdtrain.base``, ``hvdtrain.inputs``, ``hvdtrain.distributed``,
``hvdtrain.engine``. Not ``hvdtrain.tasks``: the two drivers stand side by side.
"""
