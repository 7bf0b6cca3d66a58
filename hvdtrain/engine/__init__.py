"""The run engine: one training run's life, the same under both drivers (``hvdtrain.tasks``'
compiled loop and ``hvdtrain.fit``'s ``model.fit``).

- ``run``: ``Run``, the order of a run's calls: watchdog, SIGTERM, restore and broadcast,
  epoch records, divergence, the result; ``frame``: ``RunFrame``, ``Run``'s base (the
  watchdog, SIGTERM and SIGINT, errors on every rank together); ``fronts``: what the engine
  serves (a Task from the command line, or a fit script), which words its refusals use;
- ``checkpoints``: a run's checkpoints (found, checked against the run's settings, loaded,
  saved); ``checkpoint_file``: the checkpoint file format (one self-verifying file);
- ``rundir``: the run directory (``RunDir``: the path of each of its files; its default
  name, what may not be in it, the lock that rank 0 holds); ``agreement``: every rank's
  weights compared at the end;
- ``report``: the console lines and the files of the run directory, written by rank 0, and
  ``EpochRecord``, an epoch's line of metrics.jsonl;
  ``tracking``: the experiment trackers (MLflow, W&B, TensorBoard) it feeds, from a thread;
  ``tracker_backends``: each tracker's client;
- ``watchdog``: no rank waits forever on a dead or frozen peer; ``watchdog_link``: its
  connections to rank 0 and their handshake;
- ``preflight``: before step 0, the checks that every rank agrees with rank 0.

May import: ``hvdtrain.base``, ``hvdtrain.distributed`` and ``hvdtrain._version``. It names
no task and no Keras callback: the drivers call it.
"""
