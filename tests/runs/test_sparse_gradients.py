"""Sparse gradients across ranks: a 1,000,000 x 16 Embedding trained with Adam on 2 ranks.

One 2-rank launch (horovodrun --gloo) runs the scenarios of ``sparse_gradients.py`` in turn,
each under its own Horovod timeline: ``fit`` (hk.fit), ``task`` (a Task), ``task_dense``
(the Task with HVDTRAIN_SPARSE_AS_DENSE_RATIO=0), ``fit_only_sparse`` (hk.fit of a model whose
one trainable variable is the Embedding), ``fit_small_table`` (hk.fit of a 100-row
table, the default ratio), ``reductions`` (the world's reduction of one small
sparse gradient, each way, against numpy). The timelines say what crossed the network
(each collective's kind and output shape); the weights are compared with one process's on
the same global batches, run in this interpreter. Under Keras 2 the fit path is Horovod's own
wrapper, which gathers sparse gradients itself.
"""

import collections
import json
import os

import numpy as np
import pytest

import usercode
from conftest import KERAS2, result, run
from hvdtrain.bench.cases import timeline_collectives

pytestmark = pytest.mark.keras2

SCRIPT = open(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sparse_gradients.py")
).read()
NAMES = ("fit", "task", "task_dense", "fit_only_sparse", "fit_small_table", "reductions")
ROWS, COLUMNS, STEPS = 1_000_000, 16, 8
GATHERED = 2 * 16 * 4  # both ranks' lookups in a step: 2 ranks x 16 examples x 4 ids
TABLE = ROWS * COLUMNS * 4  # the Embedding's dense gradient, bytes (64 MB)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every scenario on 2 ranks, in one launch: (output folder, the script's folder)."""
    base = tmp_path_factory.mktemp("sparse")
    folder = usercode.write(base, {"sparse_gradients": SCRIPT})
    out = base / "two"
    out.mkdir()
    p = run(
        usercode.two_ranks(folder / "sparse_gradients.py", out, *NAMES),
        usercode.env_with(folder, base, HOROVOD_TIMELINE="DYNAMIC"),
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    for name in NAMES:
        for r in (0, 1):
            outcome = json.load(open(out / f"{name}.rank{r}.json"))
            assert outcome == {"ok": True}, (name, r, outcome)
    return out, folder


def collectives(out, name):
    """{(kind, dtype, shape): count} of the run's allreduces and allgathers, and their bytes."""
    found = timeline_collectives(str(out / f"{name}.timeline.json"))
    return (
        collections.Counter((c["kind"], c["dtype"], tuple(c["shape"])) for c in found),
        sum(c["bytes"] for c in found),
    )


@pytest.mark.parametrize("name", ["fit", "task"])
def test_an_embeddings_gradient_crosses_the_network_sparse(two, name):
    """Each of the 8 steps gathers the Embedding's 128 looked-up rows (values [128, 16],
    indices [128]); nothing of the table's 1,000,000 rows is reduced. Everything reduced or
    gathered in the whole run (the gradients, the step's flags, the agreement questions) is
    under 10 KB a step, against 64 MB a step for the table dense."""
    out, _ = two
    counts, total = collectives(out, name)
    assert counts[("ALLGATHER", "float32", (GATHERED, COLUMNS))] == STEPS, counts
    assert counts[("ALLGATHER", "int32", (GATHERED,))] == STEPS, counts
    assert not [key for key in counts if ROWS in key[2]], counts
    assert total / STEPS < 10_000, (total / STEPS, counts)


def test_a_table_smaller_than_the_ranks_lookups_is_reduced_dense(two):
    """A 100-row table, 2 ranks x 64 rows looked up a step: by the default ratio (128 >= 100)
    its gradient goes dense, [100, 16] allreduced each step, decided from static shapes on
    the fit path. Under Keras 2 the fit path is Horovod's own wrapper, which gathers every
    sparse gradient: [128, 16] gathered."""
    out, _ = two
    counts, _ = collectives(out, "fit_small_table")
    dense = ("ALLREDUCE", "float32", (100, COLUMNS))
    gathered = ("ALLGATHER", "float32", (GATHERED, COLUMNS))
    taken, not_taken = (gathered, dense) if KERAS2 else (dense, gathered)
    assert counts[taken] == STEPS and not_taken not in counts, counts


def test_with_every_gradient_gathered_the_step_flags_still_ride_once_a_step(two):
    """A model whose only gradient is the Embedding's: each step gathers it and allreduces
    hk.fit's stop flags ([stop, 1], the gradients' dtype) in a round of their own, the step's
    only float32 allreduce; no host stop check per step (the flags were carried): the run's
    host questions are those of ``fit``, whose flags ride with the dense gradients."""
    out, _ = two
    counts, _ = collectives(out, "fit_only_sparse")
    assert {key: n for key, n in counts.items() if key[1] == "float32"} == {
        ("ALLGATHER", "float32", (GATHERED, 2)): STEPS,
        ("ALLREDUCE", "float32", (2,)): STEPS,
    }
    assert counts[("ALLGATHER", "int32", (GATHERED,))] == STEPS, counts
    host = {
        name: sum(n for key, n in collectives(out, name)[0].items() if key[1] == "float64")
        for name in ("fit", "fit_only_sparse")
    }
    assert host["fit_only_sparse"] == host["fit"] < STEPS + 4, host  # the run's questions


def test_gathered_or_dense_the_reduction_is_the_same_dense_gradient(two):
    """A [10, 3] variable's sparse gradient, rows repeated within and across the 2 ranks,
    reduced by the world gathered (ratio inf) and dense (ratio 0): both ways give a dense
    tensor equal to both ranks' rows summed by numpy (and halved for the average): to 1e-6
    for the average, the average predivided by 4 and the sum, to 2e-3 with fp16 compression
    (float16's precision on values up to 3). On both ranks."""
    out, _ = two
    for r in (0, 1):
        found = json.load(open(out / "reductions" / f"reductions.rank{r}.json"))
        assert len(found) == 8, found
        for key, (kind, apart) in found.items():
            assert kind == "EagerTensor" and apart < (2e-3 if "fp16" in key else 1e-6), found


def test_the_ratio_at_zero_reduces_it_dense(two):
    """HVDTRAIN_SPARSE_AS_DENSE_RATIO=0: each step allreduces the Embedding's dense gradient
    ([1000000, 16], 64 MB) in the gradients' grouped round, and gathers no gradient."""
    out, _ = two
    counts, total = collectives(out, "task_dense")
    assert counts[("ALLREDUCE", "float32", (ROWS, COLUMNS))] == STEPS, counts
    assert not [key for key in counts if key[0] == "ALLGATHER" and key[1] == "float32"], counts
    assert total / STEPS > TABLE, (total / STEPS, counts)


def test_two_ranks_train_the_embedding_as_one_process(two, tmp_path):
    """The same weights as one process on the same global batches (2 ranks of 16, one
    process of 32), Adam, the rows repeated within each rank's batch and across the ranks
    (64 ids for 64 lookups a rank): to 1e-6, on the fit path and the Task path, gathered or
    dense, with and without a dense gradient beside it. The ranks end identical, and the
    Embedding's looked-up rows moved."""
    import sys

    out, folder = two
    sys.path.insert(0, str(folder))
    try:
        import sparse_gradients as scenarios

        scenarios.hk.init()
        x, _ = scenarios.data()
        assert len(np.unique(x)) == 64 and x.size == STEPS * 32 * 4
        for name, reference in (
            ("fit", "fit"),
            ("task", "task"),
            ("task_dense", "task"),
            ("fit_only_sparse", "fit_only_sparse"),
        ):
            res = result(out / name)
            assert res["ranks_identical"] is True and res["global_step"] == STEPS, res
            one = tmp_path / reference
            if not one.exists():
                getattr(scenarios, reference)(str(one), batch_size=32)
            assert result(one)["global_batch_size"] == res["global_batch_size"] == 32
            two_w, one_w = np.load(out / name / "weights.npz"), np.load(one / "weights.npz")
            apart = max(float(np.abs(two_w[k] - one_w[k]).max()) for k in one_w.files)
            start = (scenarios.embedding_only if "only" in name else scenarios.model)()
            moved = float(
                np.abs(
                    one_w["arr_0"][7 :: ROWS // 64] - start.get_weights()[0][7 :: ROWS // 64]
                ).max()
            )
            assert apart < 1e-6 < moved, (name, apart, moved)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("sparse_gradients", None)
