"""A user's own ``tf.data`` pipeline on every rank: sharded, counted, replayable, checked.

    train = Batches(ds, world)          # every rank: shard, count, agree on the steps
    stream = train.batches(e0, e1, k)   # epochs e0..e1-1 from step k of e0, as model.fit reads

- Sharding (as MultiWorkerMirroredStrategy's auto-shard, with TensorFlow's own rewrite): by
  file when the pipeline reads files (TFRecord, text, fixed-length records) and there are
  at least as many files as ranks (the FILE policy: rank r reads files r, r + size, ...),
  else by batch (as the DATA policy: every rank reads everything and keeps every size-th
  batch, so the pipeline's order must be the same on every rank: a seeded shuffle). A
  user who shards by hand says so (``sharded=True``) and is not sharded twice. Either way
  every example is seen by exactly one rank per epoch, provided the file list is in the
  same order on every rank (``list_files(..., shuffle=False)``, or a seed).
- Equal steps: a rank's shard is counted once (one pass over it at the start) and every
  rank takes the fewest steps any rank has (one allgather); the batches a rank has beyond
  them are left out of that epoch (result.json's ``examples_left_out``). A pipeline that
  repeats forever needs ``steps_per_epoch``.
- Exact resume: a seeded ``shuffle`` reshuffles for each new iterator in a fixed sequence,
  so iteration k of a freshly built pipeline is the same in any process. Epoch e is always
  the same iteration of it (after the count's), and a resumed run creates (and drops) the
  iterators before it, then skips the batches already trained.
- Input-bound runs: the time each step waited for its batch (measured where the stream
  hands batches to the loop) is summed; per epoch the slowest rank's share of the epoch's
  time goes into metrics.jsonl (``input_wait``; see ``engine.Run.epoch_end``).
- Bad input: a corrupt or truncated file, an empty shard, an unreadable record: one line
  (``DataError`` naming the file where TensorFlow does not), agreed by every rank.
- The ranks agree before the first step (one line naming the rank and what differs): the
  same files (names and sizes; not when sharded by hand), by batch the same order (a digest
  of every batch's contents in the counting pass, which reads the whole pipeline there), and
  batches of one size. The files (names, sizes: ``identity``) and the examples per epoch
  define the run: a resume against other files is refused.
- Input that changes under a running job: every file is looked at (``check_unchanged``: its
  size and modification time) before each epoch and each checkpoint, on every rank, so a
  file cut short, rewritten or deleted stops every rank with one line naming it, before
  anything is trained on it or saved after it; an epoch whose shard runs short mid-epoch
  raises (``assert_cardinality``) instead of taking batches from the next epoch
  (``failure`` says it in one line naming the file).
"""

from __future__ import annotations

import re

import numpy as np

from hvdtrain.base.errors import ConfigError, DataError, InputError
from hvdtrain.inputs.sharding import same_files, sharded_sizes
from hvdtrain.inputs.sources import (
    batch_sizes_differ,
    corrupt_file,
    dataset_nodes,
    describe_files,
    error_cause,
    order_differs,
    stat_files,
)


class Batches:
    """A user's ``tf.data.Dataset`` of per-rank batches ((x, y) or (x, y, sample_weight)),
    a ``batches.TrainBatches`` for the fit driver, as ``hk.dataset``'s arrays are
    (``arrays.ArrayBatches``).

    All ranks construct it together (one allgather); an error on any rank (a corrupt file on
    one rank's shard) is raised on every rank. ``steps_per_epoch``: steps every rank takes
    per epoch (required when the dataset repeats forever; else at most the fewest batches
    any rank has).
    """

    seed, shuffle = 0, False  # the pipeline's own

    def __init__(
        self,
        ds,
        world,
        sharded: bool = False,
        steps_per_epoch: int | None = None,
        what: str = "the training dataset",
        batch: int | None = None,
    ):
        import tensorflow as tf

        self.world, self.what = world, what
        infinite = int(ds.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
        if infinite and not steps_per_epoch:
            raise ConfigError(
                "steps_per_epoch",
                steps_per_epoch,
                f"{what} repeats forever: "
                "give steps_per_epoch, the steps every rank takes per epoch",
            )
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ConfigError("steps_per_epoch", steps_per_epoch, "must be 1 or more")

        nodes = dataset_nodes(ds)
        everyone_files = same_files(ds, world, sharded, what, nodes)
        self.files = everyone_files[world.rank]
        self.snapshot = stat_files(p for p, _ in self.files)  # this rank's view, for later looks
        self.ds, sizes, self.policy, digest = sharded_sizes(
            ds, world, sharded, what, steps_per_epoch if infinite else None, batch, nodes
        )
        everyone = world.allgather_object((sizes, digest))
        everyone, digests = [s for s, _ in everyone], [d for _, d in everyone]
        self.used = 1  # iterations of self.ds created so far: the count's
        empty = [r for r, s in enumerate(everyone) if not s]
        if empty:
            raise InputError(
                f"{what}: rank {empty[0]}'s shard is empty (sharded {self.policy}"
                f" over {world.size} ranks): give it more files or examples"
            )
        problem = order_differs(what, digests) or batch_sizes_differ(
            what, [max(s) for s in everyone], self.policy
        )
        if problem:
            raise InputError(problem)
        fewest = min(len(s) for s in everyone)
        if steps_per_epoch and steps_per_epoch > fewest and not infinite:
            raise ConfigError(
                "steps_per_epoch",
                steps_per_epoch,
                f"{what} has only {fewest} batches on some rank; every rank must have that many",
            )
        self.steps = steps_per_epoch or fewest
        self.batch_size = max(max(s) for s in everyone)
        self.examples = sum(sum(s[: self.steps]) for s in everyone)  # trained per epoch
        self.left_out = 0 if infinite else sum(sum(s) for s in everyone) - self.examples
        # Sharded by hand: every rank's files together (the same on another world size).
        self.train_files = describe_files(
            sorted({f for files in everyone_files for f in files}) if sharded else everyone_files[0]
        )
        self.first = self._first()
        self.sample = self.first[0] if isinstance(self.first, (tuple, list)) else self.first
        self.waited = tf.Variable(0.0, dtype=tf.float64, trainable=False)  # seconds

    def _first(self):
        """The first batch (numpy), from an iterator of its own (counted)."""
        first = next(iter(self.ds.take(1)))
        self.used += 1
        return _numpy(first)

    def info(self) -> dict:
        return {
            "train_examples": self.examples,
            "examples_left_out": self.left_out,
            "sharding": self.policy,
        }

    def identity(self) -> dict:
        """What the run was trained on, for the settings a resume compares."""
        return {"train_files": self.train_files, "train_examples": self.examples}

    def changed(self) -> str | None:
        """This rank: the first of the pipeline's files that is not as it was at the start
        (deleted, cut short, grown, rewritten, unreadable), said as ``path: how``."""
        now = stat_files(self.snapshot)
        for path, (size, mtime) in self.snapshot.items():
            got = now[path]
            if isinstance(got, str):
                return f"{path}: {got} under the running job"
            if got[0] != size:
                how = "cut short" if got[0] < size else "grown"
                return f"{path}: {how} under the running job ({size:,} -> {got[0]:,} bytes)"
            if got[1] != mtime:
                return f"{path}: rewritten under the running job (modified, {size:,} bytes)"
        return None

    def check_unchanged(self, when: str) -> None:
        """All ranks: stop every rank with one line if a file changed (``when``: "before
        epoch 3") before anything is trained on it or saved after it."""

        def look():
            problem = self.changed()
            if problem:
                raise InputError(f"{problem} {when}: {STOPPED}")

        self.world.agree(look, catch=(DataError,), merge=InputError)

    def failure(self, e, epoch: int) -> DataError | None:
        """The one line for a TensorFlow error ``e`` that reading epoch ``epoch`` (from 0)
        raised on this rank alone: a file that changed, a shard that ran short, a corrupt
        file; None when it is not the input's (the step's own)."""
        import tensorflow as tf

        rank, problem = self.world.rank, self.changed()
        short = re.search(
            r"expected to contain (\d+) elements but contained only (\d+)",
            str(getattr(e, "message", e)),
        )
        where = f"in epoch {epoch + 1} (rank {rank})"
        if problem:
            return DataError(f"{problem} {where}: {STOPPED}")
        if short:
            return DataError(
                f"{self.what}: rank {rank}'s shard ended after {short.group(2)} "
                f"of its {short.group(1)} batches {where}: its input changed "
                f"under the running job; {STOPPED}"
            )
        if isinstance(e, tf.errors.DataLossError):
            found = corrupt_file(self.ds)  # None: not a training file (validation's)
            return DataError(f"{found[0]}: {found[1]} {where}") if found else None
        if isinstance(e, (tf.errors.NotFoundError, tf.errors.PermissionDeniedError)) and any(
            path in str(e) for path in self.snapshot
        ):
            return DataError(f"{self.what}: {error_cause(e)} {where}")
        return None

    def batches(self, first_epoch: int, end_epoch: int, first_step: int = 0):
        """This rank's batches from (first_epoch, first_step) to the end: epoch e is always
        the pipeline's iteration e + 2 (after the count's and the first batch's), whatever
        the process, so a seeded shuffle gives a resumed run the same order."""
        import tensorflow as tf

        target = 2 + first_epoch
        if self.used > target:
            raise RuntimeError(f"{self.what}: epoch {first_epoch} was read already")
        while self.used < target:
            iter(self.ds)  # a new iterator draws the next shuffle seeds, nothing more
            self.used += 1
        ds, steps = self.ds, self.steps
        self.used = 2 + end_epoch
        # Exactly ``steps`` batches per epoch: a shard that runs short (its input changed)
        # raises rather than take the next epoch's batches (and leave a rank without any).
        exact = tf.data.experimental.assert_cardinality(steps)
        stream = tf.data.Dataset.range(end_epoch - first_epoch).flat_map(
            lambda e: ds.take(steps).apply(exact)
        )
        return self._timed(stream.skip(first_step) if first_step else stream)

    def _timed(self, stream):
        """``stream``, adding to ``waited`` the time each batch was waited for: zip asks the
        clock, then the stream, in the consumer's own call (no prefetch after them)."""
        import tensorflow as tf

        def handed(asked, batch):
            with tf.control_dependencies(tf.nest.flatten(batch)):
                got = tf.timestamp()
            with tf.control_dependencies([self.waited.assign_add(got - asked)]):
                return tf.nest.map_structure(tf.identity, batch)

        clock = tf.data.Dataset.from_tensors(0).repeat().map(lambda _: tf.timestamp())
        timed = tf.data.Dataset.zip((clock, stream)).map(handed)
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False  # it would hide the wait
        return timed.with_options(options)

    def wait_share(self, seconds: float) -> float:
        """All ranks: the slowest rank's share of ``seconds`` spent waiting for input since
        the last call."""
        waited = float(self.waited.numpy())
        self.waited.assign(0.0)
        return max(self.world.allgather_object(min(1.0, waited / max(seconds, 1e-9))))


STOPPED = (
    "training stopped, nothing saved after it; put the input back as it was and run "
    "the same command to resume, or train on the new input in a new run directory"
)


def _numpy(x):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t), x)


def validation(
    ds, world, sharded: bool = False, batch: int | None = None, what: str = "validation_data"
) -> tuple:
    """A validation dataset as (this rank's shard, its batches): each example is scored by
    exactly one rank (no rank may be empty: its part of the exact metrics would be missing).
    ``batch``: ``ds`` holds examples, to be sharded, then batched."""
    nodes = dataset_nodes(ds)
    same_files(ds, world, sharded, what, nodes)
    mine, sizes, policy, digest = sharded_sizes(ds, world, sharded, what, batch=batch, nodes=nodes)
    everyone = world.allgather_object((sum(sizes), digest))
    counts = [n for n, _ in everyone]
    if min(counts) == 0:
        raise InputError(
            f"{what}: rank {counts.index(0)}'s shard is empty "
            f"(sharded {policy} over {world.size} ranks)"
        )
    problem = order_differs(what, [d for _, d in everyone])
    if problem:
        raise InputError(problem)
    return mine, len(sizes)
