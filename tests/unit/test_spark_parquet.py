"""hvdtrain.spark.read_parquet on Parquet laid out as Spark writes it (part files and a
_SUCCESS marker, written here with pyarrow: no JVM): the rows in the parts' order, array
columns as 2-D arrays, and one line naming what is wrong with bad data."""

import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from hvdtrain.base.errors import DataError  # noqa: E402
from hvdtrain.spark.parquet import read_parquet  # noqa: E402

pytestmark = pytest.mark.quick


def spark_like(path, parts, marker=True):
    """Parts named as Spark names them (part-0000N-<uuid>-c000.snappy.parquet); written in
    reverse so that the order read is the names', not the files' ages."""
    os.makedirs(path)
    for i in reversed(range(len(parts))):
        pq.write_table(
            pa.table(parts[i]), os.path.join(path, f"part-{i:05d}-0b1e3c7a-c000.snappy.parquet")
        )
    if marker:
        open(os.path.join(path, "_SUCCESS"), "w").close()
    return str(path)


def test_rows_come_in_the_parts_order_with_arrays_as_2d(tmp_path):
    parts = [
        {
            "features": [[float(r), r + 0.5] for r in range(i * 3, i * 3 + 3)],
            "label": [float(r) for r in range(i * 3, i * 3 + 3)],
            "id": list(range(i * 3, i * 3 + 3)),
        }
        for i in range(4)
    ]
    got = read_parquet(spark_like(tmp_path / "d", parts))
    assert list(got) == ["features", "label", "id"]
    assert got["features"].shape == (12, 2) and got["features"].dtype == np.float64
    assert got["id"].tolist() == list(range(12))
    assert got["features"][:, 1].tolist() == [r + 0.5 for r in range(12)]
    only = read_parquet(str(tmp_path / "d"), columns=["label"])
    assert list(only) == ["label"] and only["label"].tolist() == [float(r) for r in range(12)]


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing", "no such Parquet file or directory"),
        ("unfinished", "no _SUCCESS in it: not a finished Spark write"),
        (
            "ragged",
            "column 'features' has rows of different lengths (1 to 2): give them one length",
        ),
        ("nulls", "column 'label' has 1 empty values: fill or drop them before writing"),
        ("column", "no column 'nosuch' in it (it has: features, label)"),
        ("corrupt", "cannot read it as Parquet"),
        ("empty", "no rows"),
    ],
)
def test_bad_data_is_one_line_naming_it(tmp_path, case, said):
    path = tmp_path / "d"
    good = {"features": [[1.0, 2.0], [3.0, 4.0]], "label": [1.0, 2.0]}
    if case == "unfinished":
        spark_like(path, [good], marker=False)
    elif case == "ragged":
        spark_like(path, [{"features": [[1.0], [2.0, 3.0]], "label": [1.0, 2.0]}])
    elif case == "nulls":
        spark_like(path, [{"features": [[1.0], [2.0]], "label": [1.0, None]}])
    elif case == "column":
        spark_like(path, [good])
    elif case == "corrupt":
        spark_like(path, [good])
        part = next(f for f in os.listdir(path) if f.endswith(".parquet"))
        with open(path / part, "r+b") as f:
            f.truncate(40)
    elif case == "empty":
        spark_like(
            path,
            [
                {
                    "features": pa.array([], pa.list_(pa.float64())),
                    "label": pa.array([], pa.float64()),
                }
            ],
        )
    with pytest.raises(DataError) as e:
        read_parquet(str(path), columns=["nosuch"] if case == "column" else None)
    assert said in str(e.value) and "\n" not in str(e.value)
