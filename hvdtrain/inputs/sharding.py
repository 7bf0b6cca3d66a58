"""A ``tf.data`` pipeline sharded over the ranks (by file, else by batch, or by the user) and
counted: one pass over each rank's shard, then every rank takes the fewest steps any rank
has. The ranks' files, order and batch sizes are compared on the way (``sources``)."""

from __future__ import annotations

import hashlib

from hvdtrain.base.errors import DataError, InputError
from hvdtrain.inputs.sources import (
    corrupt_file,
    error_cause,
    file_facts,
    file_names,
    files_differ,
    reads_files,
)


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

    parts = [
        tf.reshape(tf.fingerprint(tf.reshape(t, [1, -1])), [-1])
        for t in tf.nest.flatten(batch, expand_composites=True)
    ]
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
        found = corrupt_file(ds)
        raise DataError(
            f"{found[0]}: {found[1]}" if found else f"{what}: {error_cause(e)}"
        ) from None
    except tf.errors.OpError as e:
        raise DataError(f"{what}: {error_cause(e)}") from None
    if digest:
        return sizes, hashed.hexdigest()[:16] if hashed is not None else None
    return sizes


def _rank_sizes(sizes: list, world, batch: int | None) -> list:
    """Rank ``world.rank``'s batch sizes under the DATA policy, from the whole pipeline's
    (``batch``: ``sizes`` are of chunks of ``batch`` x size examples, dealt out one by one)."""
    r, n = world.rank, world.size
    if not batch:
        return sizes[r::n]
    return [k for k in (min(batch, max(0, -(-(t - r) // n))) for t in sizes) if k]


def sharded_sizes(
    ds,
    world,
    sharded: bool,
    what: str,
    limit: int | None = None,
    batch: int | None = None,
    nodes=None,
):
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
                raise DataError(f"{what}: {error_cause(e)}") from None
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

    policy = (
        "user"
        if sharded
        else "none"
        if world.size == 1
        else "file"
        if reads_files(ds, nodes)
        else "data"
    )
    found = count(policy)
    # Horovod: the policy must be every rank's, or ranks would read overlapping shards.
    if policy == "file" and not all(world.allgather_object(found is not None)):
        policy, found = "data", count("data")
    return found[0], found[1], policy, found[2]


def same_files(ds, world, sharded: bool, what: str, nodes) -> list:
    """All ranks: every rank's [(path, size)] of the files its pipeline names; refused in
    one line (every rank) when they differ and hvdtrain shards them (or reads them whole)."""
    everyone = world.allgather_object(file_facts(file_names(ds, nodes)))
    problem = None if sharded else files_differ(what, everyone)
    if problem:
        raise InputError(problem)
    return everyone
