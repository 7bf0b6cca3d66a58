"""Training data from a Spark DataFrame: written once to Parquet on storage every executor
sees (``write_parquet``, on the driver), read by each rank as NumPy arrays
(``read_parquet``), in one order every rank agrees on, so that ``hk.fit`` shards them exactly
as under ``horovodrun``: each example trained once per epoch, on one rank.

    hvdtrain.spark.write_parquet(df.select("features", "label"), "/shared/data/train")

    def train():                                   # on every rank
        data = hvdtrain.spark.read_parquet("/shared/data/train")
        hk.fit(model, data["features"], data["label"], ...)

A column of numbers becomes a 1-D array; an array or ML vector column (every row the same
length) a 2-D array. Every rank reads the columns it asks for whole (the shards are taken
per step by ``hk.fit``, after its shuffle, which every rank does alike).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hvdtrain.base.errors import DataError

MARKER = "_SUCCESS"  # what Spark writes last, once every part of the write is there


def write_parquet(df, path: str, mode: str = "error") -> str:
    """Write ``df`` to Parquet at ``path`` (a directory every executor and rank sees); its ML
    vector columns as arrays of doubles. ``mode``: Spark's ("error": refuse an existing path,
    "overwrite"). Returns ``path``."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    for field in df.schema.fields:
        if isinstance(field.dataType, VectorUDT):
            df = df.withColumn(field.name, vector_to_array(field.name))
    df.write.mode(mode).parquet(path)
    return path


def _parts(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(
            f"{path}: no such Parquet file or directory (is it on storage this machine sees?)"
        )
    if not os.path.exists(os.path.join(path, MARKER)):
        raise DataError(
            f"{path}: no {MARKER} in it: not a finished Spark write (write it "
            "again with hvdtrain.spark.write_parquet)"
        )
    parts = sorted(
        f for f in os.listdir(path) if f.endswith(".parquet") and not f.startswith(("_", "."))
    )
    return [os.path.join(path, f) for f in parts]


def _array(name: str, column):
    import numpy as np
    import pyarrow as pa

    if column.null_count:
        raise DataError(
            f"column {name!r} has {column.null_count} empty values: fill or drop "
            "them before writing"
        )
    kind = column.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        chunks = column.combine_chunks()
        lengths = np.asarray(chunks.value_lengths()) if len(chunks) else np.zeros(0, int)
        if len(set(lengths.tolist())) > 1:
            raise DataError(
                f"column {name!r} has rows of different lengths "
                f"({lengths.min()} to {lengths.max()}): give them one length"
            )
        width = int(lengths[0]) if len(lengths) else 0
        values = chunks.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(chunks), width)
    if pa.types.is_struct(kind):
        raise DataError(
            f"column {name!r} is a struct: write ML vectors with "
            "hvdtrain.spark.write_parquet (it turns them into arrays)"
        )
    return column.to_numpy()


def read_parquet(path: str, columns: Sequence[str] | None = None) -> dict[str, object]:
    """The Parquet data at ``path`` as ``{column: NumPy array}``, its rows in the order Spark
    wrote them (its parts by name, each part's rows in order): the same arrays on every
    rank. ``columns``: these only (default: all)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = _parts(path)
    if not parts:
        raise DataError(f"{path}: no Parquet part files in it")
    try:
        have = pq.read_schema(parts[0]).names
        missing = [c for c in columns or () if c not in have]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} in it (it has: {', '.join(have)})")
        tables = [pq.read_table(p, columns=list(columns) if columns else None) for p in parts]
    except (OSError, pa.ArrowInvalid, KeyError) as e:
        raise DataError(
            f"{path}: cannot read it as Parquet: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
        ) from None
    table = pa.concat_tables(tables)
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    return {name: _array(name, table.column(name)) for name in table.column_names}
