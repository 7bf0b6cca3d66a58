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

import hashlib
import os
import re
from typing import Optional

import numpy as np

from hvdtrain.base.errors import ConfigError, DataError, InputError

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


def reads_files(ds, nodes=None) -> bool:
    return any(n.op.startswith(READERS) for n in (_nodes(ds) if nodes is None else nodes))


def file_names(ds, nodes=None) -> list:
    """The existing files a pipeline's graph names (its constant strings)."""
    import tensorflow as tf

    names = []
    for n in (_nodes(ds) if nodes is None else nodes):
        if n.op == "Const" and n.attr["dtype"].type == tf.string.as_datatype_enum:
            try:
                value = tf.io.parse_tensor(n.attr["value"].tensor.SerializeToString(), tf.string)
            except (tf.errors.OpError, ValueError):
                continue
            names += [s.decode(errors="replace") for s in np.ravel(value.numpy())]
    return [s for s in dict.fromkeys(names) if os.path.isfile(s)]


def _cause(e) -> str:
    """A TensorFlow op error's own message, without the function-node and op decorations,
    its first line only (an auto-shard error goes on with a graph's protobuf dump)."""
    text = str(getattr(e, "message", e)).split("[Op:")[0]
    if text.startswith("{{function_node"):
        text = text.split("}}", 1)[-1]
    text = next((line for line in text.splitlines() if line.strip()), "")
    return " ".join(text.split()).split("' failed with")[0] or type(e).__name__


def file_facts(paths) -> list:
    """[(path, size in bytes)] of ``paths`` that exist."""
    found = []
    for path in paths:
        try:
            found.append((path, os.path.getsize(path)))
        except OSError:
            pass
    return found


def describe_files(files: list) -> str:
    """The files of the input ([(path, size)]) as a run-defining value: how many, their
    bytes, a digest of their names (without their directory: a moved data directory is the
    same input) and sizes."""
    if not files:
        return "none"
    digest = hashlib.sha256("\n".join(f"{os.path.basename(p)} {n}" for p, n in files).encode())
    return (f"{len(files)} files, {sum(n for _, n in files):,} bytes, sha256 "
            f"{digest.hexdigest()[:12]}")


def files_differ(what: str, everyone: list) -> Optional[str]:
    """The first rank whose [(path, size)] list differs from rank 0's, and how; None when all
    are the same."""
    ours = everyone[0]
    for rank, theirs in enumerate(everyone[1:], 1):
        if theirs == ours:
            continue
        mine, other = [p for p, _ in ours], [p for p, _ in theirs]
        lacks = [p for p in mine if p not in other]
        extra = [p for p in other if p not in mine]
        counts = f"{len(mine)} files on rank 0, {len(other)} on rank {rank}"
        if lacks:
            how = f"rank {rank} lacks {lacks[0]}" + (f" and {len(lacks) - 1} more"
                                                     if len(lacks) > 1 else "")
        elif extra:
            how = f"rank {rank} reads {extra[0]}, which rank 0 does not"
        elif mine != other:
            at = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
            how = (f"rank {rank} lists them in another order (file {at}: {other[at]} where "
                   f"rank 0 has {mine[at]}): list them sorted (hk.files)")
        else:
            path, a, b = next((p, a, b) for (p, a), (_, b) in zip(ours, theirs) if a != b)
            how = f"{path} is {a:,} bytes on rank 0, {b:,} on rank {rank}"
        return (f"{what}: the ranks read different files: {how} ({counts}); every rank "
                "must list the same files (or shard them by hand: sharded=True)")
    return None


def order_differs(what: str, digests: list) -> Optional[str]:
    """Sharded by batch, every rank reads the whole pipeline: the first rank whose batches
    (their contents, in order) differ from rank 0's; None when all are the same."""
    for rank, digest in enumerate(digests):
        if digest is not None and digests[0] is not None and digest != digests[0]:
            return (f"{what}: rank {rank} reads its batches in another order than rank 0 "
                    "(sharded by batch, every rank keeps every size-th batch of the same "
                    "sequence): seed every shuffle alike on every rank (shuffle(n, seed=0)), "
                    "list the files sorted")
    return None


def batch_sizes_differ(what: str, largest: list, policy: str) -> Optional[str]:
    """The first rank whose largest batch differs from rank 0's; None when all agree."""
    for rank, n in enumerate(largest):
        if n != largest[0]:
            fix = ("batch every rank's shard alike" if policy == "user" else
                   "give every rank's shard at least one whole batch")
            return (f"{what}: rank {rank}'s batches hold {n} examples, rank 0's "
                    f"{largest[0]}: every rank's batches must be the per-rank batch size "
                    f"({fix})")
    return None


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


def _fingerprint(*batch):
    """A batch's size and a fingerprint of its contents (8 bytes)."""
    import tensorflow as tf

    parts = [tf.reshape(tf.fingerprint(tf.reshape(t, [1, -1])), [-1])
             for t in tf.nest.flatten(batch, expand_composites=True)]
    whole = tf.reshape(tf.concat(parts, 0), [1, -1])
    return _batch_len(*batch), tf.reshape(tf.fingerprint(whole), [8])


def _count(ds, what: str, digest: bool = False):
    """One pass over ``ds``: the size of each of its batches; one-line errors. ``digest``:
    (sizes, a digest of the batches' contents in order, None where it cannot be made)."""
    import tensorflow as tf

    hashed = None
    if digest:
        try:
            counted, hashed = ds.map(_fingerprint), hashlib.sha256()
        except (TypeError, ValueError):  # an element fingerprint cannot take: not digested
            counted = ds.map(_batch_len)
    else:
        counted = ds.map(_batch_len)
    try:
        sizes = []
        for chunk in counted.batch(4096):
            if hashed is not None:
                chunk, prints = chunk
                hashed.update(prints.numpy().tobytes())
            sizes += [int(n) for n in chunk.numpy()]
    except tf.errors.DataLossError as e:
        found = _corrupt_file(ds)
        raise DataError(f"{found[0]}: {found[1]}" if found else
                        f"{what}: {_cause(e)}") from None
    except tf.errors.OpError as e:
        raise DataError(f"{what}: {_cause(e)}") from None
    if digest:
        return sizes, hashed.hexdigest()[:16] if hashed is not None else None
    return sizes


def _rank_sizes(sizes: list, world, batch: Optional[int]) -> list:
    """Rank ``world.rank``'s batch sizes under the DATA policy, from the whole pipeline's
    (``batch``: ``sizes`` are of chunks of ``batch`` x size examples, dealt out one by one)."""
    r, n = world.rank, world.size
    if not batch:
        return sizes[r::n]
    return [k for k in (min(batch, max(0, -(-(t - r) // n))) for t in sizes) if k]


def _sharded_sizes(ds, world, sharded: bool, what: str, limit: Optional[int] = None,
                   batch: Optional[int] = None, nodes=None):
    """All ranks: (this rank's shard, its batch sizes (the first ``limit``), the policy
    used, the digest of the batches' order: by batch, every rank reads the whole pipeline
    here and digests it; else None): by file if it can be on every rank, else by element.
    ``batch``: ``ds`` holds examples, sharded first, then batched. Errors agreed."""
    import tensorflow as tf

    def count(policy):
        def attempt():
            try:
                mine = shard(ds, world, policy)
            except tf.errors.NotFoundError as e:
                if policy == "file" and "unshardable" in str(e):
                    return None  # a source besides the files (enumerate's range): by batch
                raise DataError(f"{what}: {_cause(e)}") from None
            mine = mine.batch(batch) if batch else mine
            if policy == "data":  # every rank reads everything: counted whole, digested
                whole = ds.batch(batch * world.size) if batch else ds
                n = limit and (limit if batch else limit * world.size)
                sizes, digest = _count(whole.take(n) if n else whole, what, digest=True)
                return mine, _rank_sizes(sizes, world, batch), digest
            try:
                return mine, _count(mine.take(limit) if limit else mine, what), None
            except DataError as e:
                if policy == "file" and "shard" in str(e):
                    return None  # fewer files than ranks: TensorFlow says so on some ranks
                raise
        return world.agree(attempt, catch=(DataError, tf.errors.OpError), merge=InputError)

    policy = ("user" if sharded else "none" if world.size == 1 else
              "file" if reads_files(ds, nodes) else "data")
    found = count(policy)
    # Horovod: the policy must be every rank's, or ranks would read overlapping shards.
    if policy == "file" and not all(world.allgather_object(found is not None)):
        policy, found = "data", count("data")
    return found[0], found[1], policy, found[2]


def _same_files(ds, world, sharded: bool, what: str, nodes) -> list:
    """All ranks: every rank's [(path, size)] of the files its pipeline names; refused in
    one line (every rank) when they differ and hvdtrain shards them (or reads them whole)."""
    everyone = world.allgather_object(file_facts(file_names(ds, nodes)))
    problem = None if sharded else files_differ(what, everyone)
    if problem:
        raise InputError(problem)
    return everyone


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

        nodes = _nodes(ds)
        everyone_files = _same_files(ds, world, sharded, what, nodes)
        self.files = everyone_files[world.rank]
        self.snapshot = _stat(p for p, _ in self.files)  # this rank's view, for later looks
        self.ds, sizes, self.policy, digest = _sharded_sizes(
            ds, world, sharded, what, steps_per_epoch if infinite else None, batch, nodes)
        everyone = world.allgather_object((sizes, digest))
        everyone, digests = [s for s, _ in everyone], [d for _, d in everyone]
        self.used = 1  # iterations of self.ds created so far: the count's
        empty = [r for r, s in enumerate(everyone) if not s]
        if empty:
            raise InputError(f"{what}: rank {empty[0]}'s shard is empty (sharded {self.policy}"
                             f" over {world.size} ranks): give it more files or examples")
        problem = (order_differs(what, digests) or
                   batch_sizes_differ(what, [max(s) for s in everyone], self.policy))
        if problem:
            raise InputError(problem)
        fewest = min(len(s) for s in everyone)
        if steps_per_epoch and steps_per_epoch > fewest and not infinite:
            raise ConfigError("steps_per_epoch", steps_per_epoch, f"{what} has only {fewest} "
                              "batches on some rank; every rank must have that many")
        self.steps = steps_per_epoch or fewest
        self.batch_size = max(max(s) for s in everyone)
        self.examples = sum(sum(s[:self.steps]) for s in everyone)  # trained per epoch
        self.left_out = 0 if infinite else sum(sum(s) for s in everyone) - self.examples
        # Sharded by hand: every rank's files together (the same on another world size).
        self.train_files = describe_files(sorted({f for files in everyone_files for f in files})
                                          if sharded else everyone_files[0])
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

    def identity(self) -> dict:
        """What the run was trained on, for the settings a resume compares."""
        return {"train_files": self.train_files, "train_examples": self.examples}

    def changed(self) -> Optional[str]:
        """This rank: the first of the pipeline's files that is not as it was at the start
        (deleted, cut short, grown, rewritten, unreadable), said as ``path: how``."""
        now = _stat(self.snapshot)
        for path, (size, mtime) in self.snapshot.items():
            got = now.get(path)
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

    def failure(self, e, epoch: int) -> Optional[DataError]:
        """The one line for a TensorFlow error ``e`` that reading epoch ``epoch`` (from 0)
        raised on this rank alone: a file that changed, a shard that ran short, a corrupt
        file; None when it is not the input's (the step's own)."""
        import tensorflow as tf

        rank, problem = self.world.rank, self.changed()
        short = re.search(r"expected to contain (\d+) elements but contained only (\d+)",
                          str(getattr(e, "message", e)))
        where = f"in epoch {epoch + 1} (rank {rank})"
        if problem:
            return DataError(f"{problem} {where}: {STOPPED}")
        if short:
            return DataError(f"{self.what}: rank {rank}'s shard ended after {short.group(2)} "
                             f"of its {short.group(1)} batches {where}: its input changed "
                             f"under the running job; {STOPPED}")
        if isinstance(e, tf.errors.DataLossError):
            found = _corrupt_file(self.ds)  # None: not a training file (validation's)
            return DataError(f"{found[0]}: {found[1]} {where}") if found else None
        if isinstance(e, (tf.errors.NotFoundError, tf.errors.PermissionDeniedError)) \
                and any(path in str(e) for path in self.snapshot):
            return DataError(f"{self.what}: {_cause(e)} {where}")
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
            lambda e: ds.take(steps).apply(exact))
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


STOPPED = ("training stopped, nothing saved after it; put the input back as it was and run "
           "the same command to resume, or train on the new input in a new run directory")


def _stat(paths) -> dict:
    """{path: (size, modification time in ns)}, or a string saying why there is none."""
    found = {}
    for path in paths:
        try:
            st = os.stat(path)
            with open(path, "rb"):
                pass
            found[path] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            found[path] = "deleted"
        except OSError as e:
            found[path] = f"unreadable ({e.strerror or e})"
    return found


def _numpy(x):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t), x)


def validation(ds, world, sharded: bool = False, batch: Optional[int] = None,
               what: str = "validation_data") -> tuple:
    """A validation dataset as (this rank's shard, its batches): each example is scored by
    exactly one rank (no rank may be empty: its part of the exact metrics would be missing).
    ``batch``: ``ds`` holds examples, to be sharded, then batched."""
    nodes = _nodes(ds)
    _same_files(ds, world, sharded, what, nodes)
    mine, sizes, policy, digest = _sharded_sizes(ds, world, sharded, what, batch=batch,
                                                 nodes=nodes)
    everyone = world.allgather_object((sum(sizes), digest))
    counts = [n for n, _ in everyone]
    if min(counts) == 0:
        raise InputError(f"{what}: rank {counts.index(0)}'s shard is empty "
                         f"(sharded {policy} over {world.size} ranks)")
    problem = order_differs(what, [d for _, d in everyone])
    if problem:
        raise InputError(problem)
    return mine, len(sizes)
