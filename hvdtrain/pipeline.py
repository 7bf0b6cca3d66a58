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
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from hvdtrain.errors import ConfigError, DataError, InputError

# Dataset ops that read files: a pipeline with one of them can be sharded by file.
READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")


def is_dataset(obj) -> bool:
    return hasattr(obj, "element_spec") and hasattr(obj, "as_numpy_iterator")


def files(pattern: str, world) -> list:
    """All ranks: the files matching ``pattern``, sorted (the same order on every rank);
    one line when none does on some rank (``tf.data.Dataset.list_files`` raises a traceback)."""
    import glob

    def match():
        found = sorted(glob.glob(pattern))
        if not found:
            raise DataError(f"{pattern}: matches no file")
        return found
    return world.agree(match, catch=(DataError,), merge=InputError)


def _nodes(ds) -> list:
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return list(graph.node) + [n for f in graph.library.function for n in f.node_def]


def reads_files(ds) -> bool:
    return any(n.op.startswith(READERS) for n in _nodes(ds))


def file_names(ds) -> list:
    """The existing files a pipeline's graph names (its constant strings)."""
    import tensorflow as tf

    names = []
    for n in _nodes(ds):
        if n.op == "Const" and n.attr["dtype"].type == tf.string.as_datatype_enum:
            try:
                value = tf.io.parse_tensor(n.attr["value"].tensor.SerializeToString(), tf.string)
            except (tf.errors.OpError, ValueError):
                continue
            names += [s.decode(errors="replace") for s in np.ravel(value.numpy())]
    return [s for s in dict.fromkeys(names) if os.path.isfile(s)]


def _cause(e) -> str:
    """A TensorFlow op error's own message, without the function-node and op decorations."""
    text = str(getattr(e, "message", e)).split("[Op:")[0]
    if text.startswith("{{function_node"):
        text = text.split("}}", 1)[-1]
    return " ".join(text.split()).split("' failed with")[0] or type(e).__name__


def _corrupt_file(ds) -> Optional[tuple]:
    """(path, cause) of the first of the pipeline's files that TFRecord cannot read through."""
    import tensorflow as tf

    for path in file_names(ds):
        try:
            for _ in tf.data.TFRecordDataset(path).batch(4096):
                pass
        except tf.errors.DataLossError as e:
            return path, _cause(e)
    return None


def shard(ds, world, policy: str):
    """``ds`` as this rank's shard: policy "file", "data", "user" (sharded by hand) or
    "none" (one process)."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

    if policy in ("user", "none") or world.size == 1:
        return ds
    if policy == "data":
        # Batch k to rank k mod size. (TensorFlow's DATA rewrite failed on some pipelines
        # here with its FILE policy's error.) Every rank reads everything, as under it.
        return ds.shard(world.size, world.rank)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return _AutoShardDataset(ds.with_options(options), world.size, world.rank, world.size)


def _batch_len(*batch):
    import tensorflow as tf

    return tf.shape(tf.nest.flatten(batch)[0])[0]


def _count(ds, what: str) -> list:
    """One pass over ``ds``: the size of each of its batches; one-line errors."""
    import tensorflow as tf

    try:
        sizes = [int(n) for chunk in ds.map(_batch_len).batch(4096) for n in chunk.numpy()]
    except tf.errors.DataLossError as e:
        found = _corrupt_file(ds)
        raise DataError(f"{found[0]}: {found[1]}" if found else
                        f"{what}: {_cause(e)}") from None
    except tf.errors.OpError as e:
        raise DataError(f"{what}: {_cause(e)}") from None
    return sizes


def _sharded_sizes(ds, world, sharded: bool, what: str, limit: Optional[int] = None,
                   batch: Optional[int] = None):
    """All ranks: (this rank's shard, its batch sizes (the first ``limit``), the policy
    used): by file if it can be on every rank, else by element. ``batch``: ``ds`` holds
    examples, sharded first, then batched. Errors agreed."""
    import tensorflow as tf

    def count(policy):
        def attempt():
            mine = shard(ds, world, policy)
            mine = mine.batch(batch) if batch else mine
            try:
                return mine, _count(mine.take(limit) if limit else mine, what)
            except DataError as e:
                if policy == "file" and "shard" in str(e):
                    return None  # fewer files than ranks: TensorFlow says so on some ranks
                raise
        return world.agree(attempt, catch=(DataError, tf.errors.OpError), merge=InputError)

    policy = ("user" if sharded else "none" if world.size == 1 else
              "file" if reads_files(ds) else "data")
    found = count(policy)
    # Horovod: the policy must be every rank's, or ranks would read overlapping shards.
    if policy == "file" and not all(world.allgather_object(found is not None)):
        policy, found = "data", count("data")
    return found[0], found[1], policy


class Batches:
    """A user's ``tf.data.Dataset`` of per-rank batches ((x, y) or (x, y, sample_weight)),
    the same interface as ``hvdtrain.keras.Dataset`` for the fit driver.

    All ranks construct it together (one allgather); an error on any rank (a corrupt file on
    one rank's shard) is raised on every rank. ``steps_per_epoch``: steps every rank takes
    per epoch (required when the dataset repeats forever; else at most the fewest batches
    any rank has).
    """

    seed, shuffle = 0, False  # the pipeline's own

    def __init__(self, ds, world, sharded: bool = False, steps_per_epoch: Optional[int] = None,
                 what: str = "the training dataset", batch: Optional[int] = None):
        import tensorflow as tf

        self.world, self.what = world, what
        infinite = int(ds.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
        if infinite and not steps_per_epoch:
            raise ConfigError("steps_per_epoch", steps_per_epoch, f"{what} repeats forever: "
                              "give steps_per_epoch, the steps every rank takes per epoch")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ConfigError("steps_per_epoch", steps_per_epoch, "must be 1 or more")

        self.ds, sizes, self.policy = _sharded_sizes(ds, world, sharded, what,
                                                     steps_per_epoch if infinite else None, batch)
        everyone = world.allgather_object(sizes)
        self.used = 1  # iterations of self.ds created so far: the count's
        empty = [r for r, s in enumerate(everyone) if not s]
        if empty:
            raise InputError(f"{what}: rank {empty[0]}'s shard is empty (sharded {self.policy}"
                             f" over {world.size} ranks): give it more files or examples")
        fewest = min(len(s) for s in everyone)
        if steps_per_epoch and steps_per_epoch > fewest and not infinite:
            raise ConfigError("steps_per_epoch", steps_per_epoch, f"{what} has only {fewest} "
                              "batches on some rank; every rank must have that many")
        self.steps = steps_per_epoch or fewest
        self.batch_size = max(max(s) for s in everyone)
        self.examples = sum(sum(s[:self.steps]) for s in everyone)  # trained per epoch
        self.left_out = 0 if infinite else sum(sum(s) for s in everyone) - self.examples
        self.first = self._first()
        self.sample = self.first[0] if isinstance(self.first, (tuple, list)) else self.first
        self.waited = tf.Variable(0.0, dtype=tf.float64, trainable=False)  # seconds

    def _first(self):
        """The first batch (numpy), from an iterator of its own (counted)."""
        first = next(iter(self.ds.take(1)))
        self.used += 1
        return _numpy(first)

    def info(self) -> dict:
        return {"train_examples": self.examples, "examples_left_out": self.left_out,
                "sharding": self.policy}

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
        stream = tf.data.Dataset.range(end_epoch - first_epoch).flat_map(lambda e: ds.take(steps))
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


def _numpy(x):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t), x)


def validation(ds, world, sharded: bool = False, batch: Optional[int] = None,
               what: str = "validation_data") -> tuple:
    """A validation dataset as (this rank's shard, its batches): each example is scored by
    exactly one rank (no rank may be empty: its part of the exact metrics would be missing).
    ``batch``: ``ds`` holds examples, to be sharded, then batched."""
    mine, sizes, policy = _sharded_sizes(ds, world, sharded, what, batch=batch)
    counts = world.allgather_object(sum(sizes))
    if min(counts) == 0:
        raise InputError(f"{what}: rank {counts.index(0)}'s shard is empty "
                         f"(sharded {policy} over {world.size} ranks)")
    return mine, len(sizes)
