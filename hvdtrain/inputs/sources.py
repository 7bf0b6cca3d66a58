"""What a user's ``tf.data`` pipeline reads: whether it reads files and which, their facts
(names, sizes; their size and modification time, to see a change under a running job), the
file behind a read error, and the one-line reports of how the ranks' inputs differ."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from hvdtrain.base.errors import DataError, InputError

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


def dataset_nodes(ds) -> list:
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return list(graph.node) + [n for f in graph.library.function for n in f.node_def]


def reads_files(ds, nodes=None) -> bool:
    return any(n.op.startswith(READERS) for n in (dataset_nodes(ds) if nodes is None else nodes))


def file_names(ds, nodes=None) -> list:
    """The existing files a pipeline's graph names (its constant strings)."""
    import tensorflow as tf

    names = []
    for n in dataset_nodes(ds) if nodes is None else nodes:
        if n.op == "Const" and n.attr["dtype"].type == tf.string.as_datatype_enum:
            try:
                value = tf.io.parse_tensor(n.attr["value"].tensor.SerializeToString(), tf.string)
            except (tf.errors.OpError, ValueError):
                continue
            names += [s.decode(errors="replace") for s in np.ravel(value.numpy())]
    return [s for s in dict.fromkeys(names) if os.path.isfile(s)]


def error_cause(e) -> str:
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
    return (
        f"{len(files)} files, {sum(n for _, n in files):,} bytes, sha256 {digest.hexdigest()[:12]}"
    )


def files_differ(what: str, everyone: list) -> str | None:
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
            how = f"rank {rank} lacks {lacks[0]}" + (
                f" and {len(lacks) - 1} more" if len(lacks) > 1 else ""
            )
        elif extra:
            how = f"rank {rank} reads {extra[0]}, which rank 0 does not"
        elif mine != other:
            at = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
            how = (
                f"rank {rank} lists them in another order (file {at}: {other[at]} where "
                f"rank 0 has {mine[at]}): list them sorted (hk.files)"
            )
        else:
            path, a, b = next((p, a, b) for (p, a), (_, b) in zip(ours, theirs) if a != b)
            how = f"{path} is {a:,} bytes on rank 0, {b:,} on rank {rank}"
        return (
            f"{what}: the ranks read different files: {how} ({counts}); every rank "
            "must list the same files (or shard them by hand: sharded=True)"
        )
    return None


def order_differs(what: str, digests: list) -> str | None:
    """Sharded by batch, every rank reads the whole pipeline: the first rank whose batches
    (their contents, in order) differ from rank 0's; None when all are the same."""
    for rank, digest in enumerate(digests):
        if digest is not None and digests[0] is not None and digest != digests[0]:
            return (
                f"{what}: rank {rank} reads its batches in another order than rank 0 "
                "(sharded by batch, every rank keeps every size-th batch of the same "
                "sequence): seed every shuffle alike on every rank (shuffle(n, seed=0)), "
                "list the files sorted"
            )
    return None


def batch_sizes_differ(what: str, largest: list, policy: str) -> str | None:
    """The first rank whose largest batch differs from rank 0's; None when all agree."""
    for rank, n in enumerate(largest):
        if n != largest[0]:
            fix = (
                "batch every rank's shard alike"
                if policy == "user"
                else "give every rank's shard at least one whole batch"
            )
            return (
                f"{what}: rank {rank}'s batches hold {n} examples, rank 0's "
                f"{largest[0]}: every rank's batches must be the per-rank batch size "
                f"({fix})"
            )
    return None


def corrupt_file(ds) -> tuple | None:
    """(path, cause) of the first of the pipeline's files that TFRecord cannot read through."""
    import tensorflow as tf

    for path in file_names(ds):
        try:
            for _ in tf.data.TFRecordDataset(path).batch(4096):
                pass
        except tf.errors.DataLossError as e:
            return path, error_cause(e)
    return None


def stat_files(paths) -> dict:
    """{path: (size, modification time in ns)}, or a string saying why there is none."""
    found: dict[str, tuple[int, int] | str] = {}
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
