"""The sparse case: an Embedding's gradient across 2 ranks, gathered against reduced dense.

    sparse(out, rows, columns, batch, steps)   # the bench's case: two 2-rank Task runs
    python -m hvdtrain.bench.sparse_case RUN_DIR ROWS COLUMNS BATCH STEPS   # one rank

Each variant trains Embedding(ROWS, COLUMNS) -> mean -> Dense(2) with Adam by the Task path,
BATCH examples of 4 ids per rank, STEPS updates one per compiled call, under a Horovod
timeline: ``gathered`` with hvdtrain's default ratio, ``dense`` with
HVDTRAIN_SPARSE_AS_DENSE_RATIO=0. Per variant: the bytes every allreduce and allgather of the
run put out, per step (from the timeline: an allgather's output is every rank's rows), and
samples/s over the steps after the first call (result.json's ``training`` seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from hvdtrain import bench
from hvdtrain.bench.cases import CONTROLLER, NP, timeline_collectives

IDS = 4  # ids per example
VARIANTS = {"gathered": {}, "dense": {"HVDTRAIN_SPARSE_AS_DENSE_RATIO": "0"}}


def sparse(out, rows: int, columns: int, batch: int, steps: int) -> dict:
    """Both variants, one after the other; the numbers of each (see the module)."""
    work = os.path.join(out, "runs", "sparse")
    result = {
        "rows": rows,
        "columns": columns,
        "batch_per_rank": batch,
        "ranks": NP,
        "steps": steps,
        "variants": {},
    }
    for variant, extra in VARIANTS.items():
        run_dir = os.path.join(work, variant)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        timeline = os.path.join(run_dir, "timeline.json")
        cmd = bench.python("hvdtrain.bench.sparse_case", run_dir, rows, columns, batch, steps)
        wall = bench.run(
            bench.horovodrun(NP, CONTROLLER, cmd), bench.env(HOROVOD_TIMELINE=timeline, **extra)
        )
        with open(os.path.join(run_dir, "result.json")) as f:
            done = json.load(f)
        found = timeline_collectives(timeline)
        seconds = done["timings"]["training"]
        row = {
            "wall": wall,
            "bytes_per_step": sum(c["bytes"] for c in found) / steps,
            "allgathers": sum(c["kind"] == "ALLGATHER" for c in found),
            "samples_per_sec": (steps - 1) * done["global_batch_size"] / seconds,
            "largest": max(found, key=lambda c: c["bytes"])["shape"],
        }
        result["variants"][variant] = row
        bench.progress(
            f"sparse, {variant}: {row['bytes_per_step'] / 1e6:.3f} MB a step, "
            f"{row['samples_per_sec']:.0f} samples/s"
        )
    v = result["variants"]
    result["ratios"] = {
        "bytes dense/gathered": v["dense"]["bytes_per_step"] / v["gathered"]["bytes_per_step"],
        "samples/s gathered/dense": v["gathered"]["samples_per_sec"]
        / v["dense"]["samples_per_sec"],
    }
    return result


def main(run_dir, rows, columns, batch, steps) -> None:
    """One rank of a variant: the Task path, one epoch of ``steps`` updates."""
    import numpy as np

    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data

    k = keras()
    rows, columns, batch, steps = int(rows), int(columns), int(batch), int(steps)
    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, size=(steps * batch * NP, IDS)).astype("int32")
    y = (x[:, 0] < rows // 2).astype("int64")

    class Embed(hvdtrain.Task):
        name = "sparse-bench"

        def load_data(self, config, world):
            return Data(x, y, x[:batch], y[:batch])

        def build_model(self, config):
            return k.Sequential(
                [
                    k.Input((IDS,), dtype="int32"),
                    k.layers.Embedding(rows, columns),
                    k.layers.GlobalAveragePooling1D(),
                    k.layers.Dense(2, activation="softmax"),
                ]
            )

        def build_optimizer(self, config, learning_rate):
            return k.optimizers.Adam(1e-3)

        def loss(self, y, pred):
            return k.losses.sparse_categorical_crossentropy(y, pred)

    # One update per call: the first call (tracing) is left out of the samples/s.
    hvdtrain.train(
        Embed(),
        hvdtrain.Config(
            run_dir=run_dir,
            epochs=1,
            batch_size=batch,
            steps_per_execution=1,
            checkpoint_every=0,
            save_model=False,
            verbose=0,
        ),
        hvdtrain.world(),
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
