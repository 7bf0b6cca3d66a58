"""Users' own scripts, round 2 (issue 30): the inputs and the state Keras users bring.

One 2-rank launch (horovodrun --gloo) runs every scenario of ``users2.py`` in turn (each its
own hk.fit or Task run, its outcome written per rank as JSON), shared by the tests below; the
one-process references run in this interpreter. Scenarios:
- ``dicts``: a two-input two-output functional model fed dicts (x, y, sample_weight, and
  validation data), which must train as one process at the global batch;
- ``vocab_per_rank``, ``norm_per_rank``, ``task_vocab_per_rank``: each rank adapts a
  StringLookup or a Normalization on its own shard: refused before step 0, on both paths,
  naming the layer and what differs, nothing written;
- ``vocab_adapt``: ``hk.adapt`` gives every rank rank 0's vocabulary, and it trains.
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
    import hvdtrain
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    from hvdtrain.data import Data

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

    WORDS = np.array("the cat sat on a mat and the dog ran off".split())

    def text_data():
        rng = np.random.default_rng(0)
        x = rng.choice(WORDS, size=(128, 1))
        return x, (np.char.str_len(x[:, 0]) > 2).astype("int64")

    def text_model(lookup):
        k.utils.set_random_seed(1)
        inp = k.Input((1,), dtype="string")
        h = k.layers.Flatten()(k.layers.Embedding(16, 4)(lookup(inp)))
        model = k.Model(inp, k.layers.Dense(2, activation="softmax")(h))
        model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def own_shard(x):  # what a user's per-rank data loading gives each rank
        return x[hk.rank()::hk.size()]

    def vocab_per_rank(run_dir):
        x, y = text_data()
        lookup = k.layers.StringLookup(name="words")
        lookup.adapt(own_shard(x)[:5])  # rank 1's first five words leave some out
        hk.fit(text_model(lookup), hk.dataset(x, y, batch_size=16), epochs=1, run_dir=run_dir)

    def vocab_adapt(run_dir):
        x, y = text_data()
        lookup = k.layers.StringLookup(name="words")
        hk.adapt(lookup, own_shard(x)[:5])  # rank 0's five words, on every rank
        model = text_model(lookup)
        hk.fit(model, hk.dataset(x, y, batch_size=16), epochs=1, run_dir=run_dir, verbose=0)
        return {"vocabulary": [str(w) for w in lookup.get_vocabulary()],
                "rank0": sorted({str(w) for w in x[0::hk.size()][:5, 0]})}

    def norm_model():
        x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
        norm = k.layers.Normalization(name="scale")
        norm.adapt(own_shard(x))  # the same shapes on every rank: no broadcast would fail
        k.utils.set_random_seed(1)
        model = k.Sequential([k.Input((3,)), norm, k.layers.Dense(2, activation="softmax")])
        return model, x, (x[:, 0] > 0).astype("int64")

    def norm_per_rank(run_dir):
        model, x, y = norm_model()
        model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy")
        hk.fit(model, hk.dataset(x, y, batch_size=8), epochs=1, run_dir=run_dir)

    class NormTask(hvdtrain.Task):
        name = "norm"

        def load_data(self, config, world):
            _, x, y = norm_model()
            return Data(x, y, x[:8], y[:8])

        def build_model(self, config):
            return norm_model()[0]

        def loss(self, y, pred):
            return k.losses.sparse_categorical_crossentropy(y, pred)

    def task_norm_per_rank(run_dir):
        hvdtrain.train(NormTask(), hvdtrain.Config(run_dir=run_dir, epochs=1, batch_size=8,
                                                   verbose=0), hvdtrain.world())

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
NAMES = ("dicts", "vocab_per_rank", "vocab_adapt", "norm_per_rank", "task_norm_per_rank")


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


@pytest.mark.keras2  # Keras 2 keeps lookup tables and their handlers otherwise
def test_per_rank_vocabularies_are_refused_naming_the_layer(two):
    outcomes, out, _ = two
    for o in outcomes["vocab_per_rank"]:  # every rank raised the same one line
        assert o["status"] == 1 and o["type"] == "PreflightError", o
        assert "\n" not in o["error"]
        assert "layer 'words' vocabulary differs (rank 0: " in o["error"], o["error"]
        assert " entries, sha256 " in o["error"] and "; rank 1: " in o["error"]
        assert "hk.adapt(layer, data)" in o["error"]
    assert outcomes["vocab_per_rank"][0] == outcomes["vocab_per_rank"][1]
    assert not (out / "vocab_per_rank").exists()  # nothing written


@pytest.mark.keras2
def test_per_rank_normalization_is_refused_on_both_paths(two):
    """The same shapes on every rank (the broadcast would succeed, the model would differ):
    Normalization's mean and variance, not weights, are compared too."""
    outcomes, out, _ = two
    for name in ("norm_per_rank", "task_norm_per_rank"):
        for o in outcomes[name]:
            assert o["status"] == 1 and o["type"] == "PreflightError", (name, o)
            assert "layer 'scale' mean differs (rank 0: [1, 3] float32" in o["error"], o
            assert "layer 'scale' variance differs" in o["error"]
        assert not (out / name).exists()


@pytest.mark.keras2  # Keras 2 keeps lookup tables and their handlers otherwise
def test_hk_adapt_gives_every_rank_rank_0s_vocabulary(two):
    outcomes, out, _ = two
    mine = [o["result"] for o in outcomes["vocab_adapt"]]
    assert mine[0]["vocabulary"] == mine[1]["vocabulary"]
    assert sorted(mine[0]["vocabulary"][1:]) == mine[0]["rank0"]  # [UNK], then rank 0's words
    assert result(out / "vocab_adapt")["ranks_identical"] is True


def test_a_failed_collectives_line_keeps_horovods_reason():
    """TensorFlow's op error as a failed broadcast of mismatched shapes raises it on 2 ranks
    (captured from one): the one line is Horovod's reason, not the "Graph execution error:"
    header, on every path that says an error in one line (errors.first_line)."""
    from hvdtrain.errors import error_line, first_line

    message = textwrap.dedent("""\
        Graph execution error:

        Detected at node HorovodBroadcast_Variable_0 defined at (most recent call last):
          File "/tmp/u2/exp3.py", line 7, in <module>

          File "/work/wt-30/hvdtrain/distributed.py", line 250, in broadcast_variables

          File "<string>", line 656, in horovod_broadcast

        Mismatched BROADCAST tensor shapes: One rank sent a tensor of shape [10, 4], but \
another rank sent a tensor of shape [11, 4].
        \t [[{{node HorovodBroadcast_Variable_0}}]] [Op:__inference_group_8]""")
    assert first_line(message) == ("Mismatched BROADCAST tensor shapes: One rank sent a tensor "
                                   "of shape [10, 4], but another rank sent a tensor of shape "
                                   "[11, 4].")

    class FailedPreconditionError(Exception):
        pass

    assert error_line(FailedPreconditionError(message)).startswith(
        "FailedPreconditionError: Mismatched BROADCAST tensor shapes:")
    assert first_line("File not found: x\nmore") == "File not found: x"  # no header: as before
