"""Users' own scripts, round 2 (issue 30): the inputs and the state Keras users bring.

One 2-rank launch (horovodrun --gloo) runs every scenario of ``users2.py`` in turn (each its
own hk.fit or Task run, its outcome written per rank as JSON), shared by the tests below; the
one-process references run in this interpreter. Scenarios:
- ``dicts``: a two-input two-output functional model fed dicts (x, y, sample_weight, and
  validation data), which must train as one process at the global batch.
"""
import json
import os
import sys
import textwrap

import numpy as np
import pytest

import usercode
from conftest import result, run

SCENARIOS = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    k = keras()

    def dict_data():
        rng = np.random.default_rng(0)
        n = 256
        xa = rng.normal(size=(n, 4)).astype("float32")
        xb = rng.normal(size=(n, 3)).astype("float32")
        y_cls = (xa[:, 0] + xb[:, 0] > 0).astype("int64")
        y_reg = (xa[:, 1] - xb[:, 1]).astype("float32")[:, None]
        weight = rng.uniform(0.5, 1.5, size=n).astype("float32")
        return {"a": xa, "b": xb}, {"cls": y_cls, "reg": y_reg}, weight

    def dicts(run_dir, batch_size=16):
        x, y, weight = dict_data()
        k.utils.set_random_seed(1)
        a, b = k.Input((4,), name="a"), k.Input((3,), name="b")
        h = k.layers.Dense(8, activation="tanh")(k.layers.Concatenate()([a, b]))
        model = k.Model({"a": a, "b": b},
                        {"cls": k.layers.Dense(2, activation="softmax", name="cls")(h),
                         "reg": k.layers.Dense(1, name="reg")(h)})
        model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"})
        val = ({name: v[:40] for name, v in x.items()}, {name: v[:40] for name, v in y.items()})
        history = hk.fit(model, hk.dataset(x, y, batch_size=batch_size, seed=3,
                                           sample_weight=weight),
                         epochs=2, validation_data=val, run_dir=run_dir, verbose=0)
        return {"history": history.history}

    def main(out, names):
        hk.init()
        for name in names:
            run_dir = os.path.join(out, name)
            try:
                outcome = {"result": globals()[name](run_dir)}
            except hk.Error as e:
                outcome = {"error": str(e), "status": e.status, "type": type(e).__name__}
            with open(os.path.join(out, f"{name}.rank{hk.rank()}.json"), "w") as f:
                json.dump(outcome, f)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2:])
""")
NAMES = ("dicts",)


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    base = tmp_path_factory.mktemp("users2")
    return usercode.write(base, {"users2": SCENARIOS}), base


@pytest.fixture(scope="module")
def two(code):
    """Every scenario on 2 ranks, in one launch: {name: [rank 0's outcome, rank 1's]}."""
    folder, base = code
    out = base / "two"
    out.mkdir()
    p = run(usercode.two_ranks(folder / "users2.py", out, *NAMES),
            usercode.env_with(folder, base), timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    outcomes = {}
    for name in NAMES:
        outcomes[name] = [json.load(open(out / f"{name}.rank{r}.json")) for r in (0, 1)]
    return outcomes, out, p


@pytest.fixture(scope="module")
def scenarios(code):
    """users2.py imported in this process (one process: Horovod of size 1)."""
    folder, _ = code
    sys.path.insert(0, str(folder))
    try:
        import users2
        users2.hk.init()
        yield users2
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("users2", None)


def weights(run_dir):
    from hvdtrain.compat import keras

    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    return [np.asarray(w) for w in model.get_weights()]


def test_dict_inputs_train_like_one_process_at_the_global_batch(two, scenarios, tmp_path):
    """Dicts of inputs and outputs, sample weights, validation dicts: 2 ranks of 16 are one
    process of 32 (SGD), weights to 1e-6, and the same global metrics."""
    outcomes, out, _ = two
    assert all("error" not in o for o in outcomes["dicts"]), outcomes["dicts"]
    one_dir = str(tmp_path / "one")
    one = scenarios.dicts(one_dir, batch_size=32)
    res = result(out / "dicts")
    assert res["ranks_identical"] is True and res["global_step"] == 2 * (256 // 32)
    assert res["global_batch_size"] == 32 == result(one_dir)["global_batch_size"]
    a, b = weights(one_dir), weights(out / "dicts")
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-6
    assert max(float(np.abs(x).max()) for x in b) > 0.1  # it trained
    two_history = outcomes["dicts"][0]["result"]["history"]
    for key in ("loss", "cls_loss", "reg_loss", "val_loss"):
        assert key in two_history
        assert np.allclose(two_history[key], one["history"][key], atol=1e-5), key
    assert two_history["loss"][1] < two_history["loss"][0]
