"""Users' own scripts: the inputs and the state Keras users bring.

One 2-rank launch (horovodrun --gloo) runs every scenario of ``patterns.py`` in turn (each its
own hk.fit or Task run, its outcome written per rank as JSON), shared by the tests below; the
one-process references run in this interpreter. Scenarios:
- ``dicts``: a two-input two-output functional model fed dicts (x, y, sample_weight, and
  validation data), which must train as one process at the global batch;
- ``vocab_per_rank``, ``norm_per_rank``, ``task_norm_per_rank``: each rank adapts a
  StringLookup or a Normalization on its own shard: refused before step 0, on both paths,
  naming the layer and what differs, nothing written;
- ``vocab_adapt``: ``hk.adapt`` gives every rank rank 0's vocabulary, and it trains;
- ``two_phase`` (transfer learning, two hk.fit calls), ``early`` (EarlyStopping), ``grown``,
  ``lr_changed``: run, then run again by a second launch as the same command (``again``):
  a finished run trains nothing and rewrites nothing, more epochs train on, other settings
  are refused naming the script's own arguments with the values as written;
- ``page_transfer``: the patterns page's opening script, as printed, run as a script on the
  same 2 ranks: it trains the weights ``two_phase`` trains;
- ``gan``, ``gan_plain_d``: Keras' GAN pattern (two optimizers, its own train_step, a model
  Keras cannot save whole): trains when both are distributed, refused naming the other;
- ``embed_adam``, ``task_embed_adam``: Adam and an Embedding (a sparse gradient) on both
  paths, which must train as one process at the global batch;
- ``drifting``: a train_step that moves a weight by hand on each rank: stopped at the first
  checkpoint, naming the ranks.
"""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import usercode
from conftest import KERAS2, result, run
from docs_pages import block

# Every scenario under Keras 2 too: its lookup layers keep tables and handlers otherwise, and
# its optimizer wrapper reduced nothing in a train_step of the model's own (a GAN's).
pytestmark = pytest.mark.keras2

# The scenarios' script, launched as the user's own code (a copy named patterns.py).
SCENARIOS = open(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "keras_patterns.py")
).read()
NAMES = (
    "dicts",
    "vocab_per_rank",
    "vocab_adapt",
    "norm_per_rank",
    "task_norm_per_rank",
    "two_phase",
    "page_transfer",
    "early",
    "grown",
    "lr_changed",
    "gan",
    "gan_plain_d",
    "embed_adam",
    "task_embed_adam",
    "drifting",
)
AGAIN = ("two_phase", "early", "grown", "lr_changed")  # run again, as the same command


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    base = tmp_path_factory.mktemp("patterns")
    page = block("guides/keras-fit-patterns.md", "import numpy as np\n").text
    return usercode.write(base, {"patterns": SCENARIOS, "transfer": page}), base


@pytest.fixture(scope="module")
def two(code):
    """Every scenario on 2 ranks, in one launch: {name: [rank 0's outcome, rank 1's]}."""
    folder, base = code
    out = base / "two"
    out.mkdir()
    p = run(
        usercode.two_ranks(folder / "patterns.py", out, *NAMES),
        usercode.env_with(folder, base),
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    outcomes = {}
    for name in NAMES:
        outcomes[name] = [json.load(open(out / f"{name}.rank{r}.json")) for r in (0, 1)]
    return outcomes, out, p


@pytest.fixture(scope="module")
def again(code, two):
    """The scenarios of AGAIN run a second time on 2 ranks, as the same command run again:
    (outcomes, result.json's bytes before it, the launch)."""
    folder, base = code
    _, out, _ = two
    before = {
        name: {str(f): f.read_bytes() for f in out.glob(f"{name}/**/result.json")} for name in AGAIN
    }
    p = run(
        usercode.two_ranks(folder / "patterns.py", out, "again", *AGAIN),
        usercode.env_with(folder, base),
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    outcomes = {
        name: [json.load(open(out / f"{name}.again.rank{r}.json")) for r in (0, 1)]
        for name in AGAIN
    }
    return outcomes, before, p


@pytest.fixture(scope="module")
def scenarios(code):
    """patterns.py imported in this process (one process: Horovod of size 1)."""
    folder, _ = code
    sys.path.insert(0, str(folder))
    try:
        import patterns

        patterns.hk.init()
        yield patterns
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("patterns", None)


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
    from hvdtrain.base.errors import error_line, first_line

    message = textwrap.dedent("""\
        Graph execution error:

        Detected at node HorovodBroadcast_Variable_0 defined at (most recent call last):
          File "/tmp/u2/exp3.py", line 7, in <module>

          File "/work/wt-30/hvdtrain/distributed.py", line 250, in broadcast_variables

          File "<string>", line 656, in horovod_broadcast

        Mismatched BROADCAST tensor shapes: One rank sent a tensor of shape [10, 4], but \
another rank sent a tensor of shape [11, 4].
        \t [[{{node HorovodBroadcast_Variable_0}}]] [Op:__inference_group_8]""")
    assert first_line(message) == (
        "Mismatched BROADCAST tensor shapes: One rank sent a tensor "
        "of shape [10, 4], but another rank sent a tensor of shape "
        "[11, 4]."
    )

    class FailedPreconditionError(Exception):
        pass

    assert error_line(FailedPreconditionError(message)).startswith(
        "FailedPreconditionError: Mismatched BROADCAST tensor shapes:"
    )
    assert first_line("File not found: x\nmore") == "File not found: x"  # no header: as before
    # A tf.data map's py_function that raised (captured from one): the exception, not the
    # "<stack traces unavailable>" placeholder, tf.data's iterator path or the trace.
    raised = textwrap.dedent("""\
        Graph execution error:

        Detected at node EagerPyFunc defined at (most recent call last):
        <stack traces unavailable>
        Error in user-defined function passed to MapDataset:1 transformation with iterator: \
Iterator::Root::Map::Zip[1]::FlatMap[0]::FiniteTake::BatchV2::Shard::Map::Map: ValueError: \
record 151 is unreadable
        Traceback (most recent call last):

          File "/tmp/bad_map.py", line 37, in flaky

        ValueError: record 151 is unreadable


        \t [[{{node EagerPyFunc}}]]
        \t [[IteratorGetNext]] [Op:__inference_run_1234]""")
    assert first_line(raised) == (
        "ValueError: record 151 is unreadable (in the function given to tf.data's map)"
    )


def test_two_phases_of_transfer_learning_each_train_in_their_own_run_dir(two, again):
    outcomes, out, _ = two
    first = [o["result"] for o in outcomes["two_phase"]]
    assert first[0]["digest"] == first[1]["digest"]  # ranks identical after both phases
    frozen, unfrozen = first[0]["base_moved"]
    assert frozen == 0 and unfrozen > 1e-3  # the frozen base moved in phase 2 only
    assert first[0]["epochs"] == [[0, 1], [0, 1]]
    for phase in ("head", "finetune"):
        res = result(out / "two_phase" / phase)
        assert res["ranks_identical"] is True and res["global_step"] == 2 * 256 // 32
    assert result(out / "two_phase" / "finetune")["learning_rate"] == 0.05  # as written
    said, status = first[0]["same_run_dir"]  # a third phase in a finished phase's run_dir
    assert status == 2 and said.startswith("hk.fit(run_dir=") and "its own run_dir" in said
    # The whole script again: both phases finished, nothing trains, nothing is rewritten,
    # and the model ends with the trained weights (each phase's newest checkpoint).
    outcomes, before, p = again
    rerun = [o["result"] for o in outcomes["two_phase"]]
    assert rerun[0]["digest"] == rerun[1]["digest"] == first[0]["digest"]
    assert rerun[0]["loss"] == first[0]["loss"]  # the History from metrics.jsonl
    assert {f: open(f, "rb").read() for f in before["two_phase"]} == before["two_phase"]
    assert p.stderr.count("holds a finished run (2 epochs, step 16): nothing to train") >= 2


def test_the_pages_transfer_script_as_printed_trains_what_two_phase_trains(two):
    """The patterns page's opening script, run as a script on the 2 ranks: both phases, each
    in its own run directory, end with the weights and losses of the two_phase scenario."""
    outcomes, out, _ = two
    page = [o["result"] for o in outcomes["page_transfer"]]
    first = outcomes["two_phase"][0]["result"]
    assert page[0]["digest"] == page[1]["digest"] == first["digest"]
    assert page[0]["loss"] == first["loss"]
    for phase in ("head", "finetune"):
        res = result(out / "page_transfer" / "runs" / "tl" / phase)
        assert res["ranks_identical"] is True and res["global_step"] == 2 * 256 // 32


def test_a_rerun_of_a_finished_early_stopped_run_does_not_train(two, again):
    """Also: restore_best_weights is what result.json reports, and Keras' own line from
    the callback (verbose=1) comes once, from rank 0."""
    outcomes, out, p = two
    first = outcomes["early"][0]["result"]
    assert first["epochs"] == [0, 1] and first["step"] == 16  # stopped after 2 of 4 epochs
    res, records = (
        result(out / "early"),
        [json.loads(line) for line in open(out / "early" / "metrics.jsonl")],
    )
    assert res["restored_best_epoch"] == 1 and len(records) == 2
    assert res["final_val_loss"] == records[0]["val_loss"] != records[1]["val_loss"]
    import hashlib  # model.keras holds the restored weights, the ones the script ends with

    saved = hashlib.sha256(b"".join(w.tobytes() for w in weights(out / "early"))).hexdigest()
    assert saved == first["digest"] == outcomes["early"][1]["result"]["digest"]
    assert p.stdout.count("Epoch 2: early stopping") == 1, p.stdout[-3000:]
    outcomes, before, p = again
    rerun = [o["result"] for o in outcomes["early"]]
    assert rerun[0] == rerun[1] == first  # restored to where it stopped, not trained on
    assert {f: open(f, "rb").read() for f in before["early"]} == before["early"]
    assert f"{out / 'early'} holds a finished run (4 epochs, step 16)" in p.stderr


def test_more_epochs_train_on_and_changed_settings_are_named_as_written(two, again):
    outcomes, out, _ = two
    assert outcomes["grown"][0]["result"] == {"epochs": [0], "step": 8}
    assert result(out / "lr_changed")["learning_rate"] == 0.1
    outcomes, _, _ = again
    assert outcomes["grown"][0]["result"] == {"epochs": [1], "step": 16}
    assert result(out / "grown")["global_step"] == 16
    for o in outcomes["lr_changed"]:
        assert o["status"] == 1 and o["type"] == "RankError", o  # rank 0 found it
        assert (
            "was made with other settings (the optimizer's learning_rate 0.1 -> 0.01)" in o["error"]
        ), o
        assert o["error"].endswith("or choose a new run_dir")


def test_the_same_task_command_again_trains_nothing(scenarios, tmp_path, capfd):
    """The Task path (in this process): a finished run's command again is a no-op that says
    so and returns the run's result; more epochs train on."""
    import hvdtrain
    from hvdtrain.tasks.linear import LinearTask

    def train(epochs):
        config = hvdtrain.preset(
            "linear", run_dir=str(tmp_path), verbose=0, num_workers=1, epochs=epochs
        )
        return hvdtrain.train(LinearTask(), config, hvdtrain.world())

    first = train(2)
    before = (tmp_path / "result.json").read_bytes()
    capfd.readouterr()
    assert train(2) == json.loads(before) == json.loads(json.dumps(first))
    assert (tmp_path / "result.json").read_bytes() == before
    assert (
        f"{tmp_path} holds a finished run (2 epochs, step 2): nothing to train"
        in capfd.readouterr().err
    )
    assert train(3)["global_step"] == 3  # the full batch: one step an epoch


def test_a_gan_with_two_distributed_optimizers_trains_and_keeps_its_weights(two):
    """The Keras guide's GAN pattern: compile(d_optimizer=..., g_optimizer=...) over
    super().compile(): both distributed, it trains with ranks identical; Keras cannot save
    the subclassed model whole, so its weights are saved instead, with one warning."""
    import h5py

    outcomes, out, p = two
    mine = [o.get("result", o) for o in outcomes["gan"]]
    assert "history" in mine[0], mine[0]
    assert mine[0]["digest"] == mine[1]["digest"] and mine[0]["moved"][0] > 1e-3
    assert mine[0]["steps"] == [8, 8]  # each optimizer applied once per step
    res = result(out / "gan")
    assert res["ranks_identical"] is True and res["global_step"] == 8
    if KERAS2:  # tf_keras saves the subclassed model whole (its SavedModel-style config)
        assert res["model"].endswith("model.keras") and (out / "gan" / "model.keras").exists()
        return
    assert res["model"].endswith("model.weights.h5") and not (out / "gan" / "model.keras").exists()
    warned = [l for l in p.stderr.splitlines() if "model.keras not saved" in l]
    assert len(warned) == 1 and "Keras cannot save this GAN whole" in warned[0], p.stderr[-3000:]
    with h5py.File(out / "gan" / "model.weights.h5") as f:  # the weights, as Keras wrote them
        assert len(f.keys()) > 0


def test_a_gan_with_an_undistributed_optimizer_is_refused_naming_it(two):
    outcomes, out, _ = two
    for o in outcomes["gan_plain_d"]:
        assert o.get("status") == 1, o
        assert o["error"] == (
            "hk.fit: the model's d_optimizer (Adam) is not distributed: the 2 "
            "ranks would train 2 independent models; compile with "
            "hk.DistributedOptimizer(optimizer)"
        )
    assert not (out / "gan_plain_d").exists()


@pytest.mark.quick
def test_nested_inputs_are_counted_and_named_leaf_by_leaf():
    from hvdtrain.base.errors import DataError
    from hvdtrain.inputs import nest

    x = {"a": np.zeros((6, 2)), "b": [np.zeros((6, 1)), np.zeros((6, 3))]}
    assert nest.examples("hk.dataset", [("x", x), ("y", np.zeros(6))]) == 6
    assert nest.shapes(x) == {"['a']": (2,), "['b'][0]": (1,), "['b'][1]": (3,)}
    picked = nest.take(x, np.array([4, 1]))
    assert picked["b"][1].shape == (2, 3) and isinstance(picked["b"], list)
    assert nest.arrays([[0, 1], [1, 0]]).shape == (2, 2)  # a list of numbers is one array
    with pytest.raises(
        DataError,
        match=r"hk.dataset: x\['a'\] has 6 examples but "
        r"y\['cls'\] has 5",
    ):
        nest.examples("hk.dataset", [("x", {"a": np.zeros(6)}), ("y", {"cls": np.zeros(5)})])


def test_ranks_identical_compares_the_state_outside_the_weights():
    """The same weights with another Normalization mean on rank 1 (a layer adapted again in
    training, say): not identical, and rank 1 named."""
    from conftest import FakeWorld
    from hvdtrain.compat import keras
    from hvdtrain.engine.agreement import ranks_differ_line, weights_agreement

    k = keras()
    norm = k.layers.Normalization()
    norm.adapt(np.arange(8, dtype="float32").reshape(4, 2))
    model = k.Sequential([k.Input((2,)), norm, k.layers.Dense(1)])

    class Peer(FakeWorld):  # rank 1 answers with its own (digest, state)
        def allgather_object(self, obj):
            return [obj] + [self.others(obj)]

    same = weights_agreement(Peer(lambda mine: mine), model)
    assert same["ranks_identical"] is True
    other = weights_agreement(
        Peer(
            lambda mine: (
                mine[0],
                {**mine[1], "layer 'normalization' mean": "[1, 2] float32, sha256 x"},
            )
        ),
        model,
    )
    assert other["ranks_identical"] is False and other["weights_sha256"] == same["weights_sha256"]
    assert (same["differ"], other["differ"]) == ([], [1])
    assert ranks_differ_line([1], 8, fit=True).startswith(
        "the model of rank(s) [1] differs from rank 0's at step 8 (weights or layers' state)"
    )


def test_adam_and_an_embedding_train_like_one_process_on_both_paths(two, scenarios, tmp_path):
    """An Embedding's gradient is sparse (IndexedSlices): N ranks reduce it dense, and one
    process applies it dense too (Keras 3's Adam updates a sparse gradient's moments
    otherwise: 0.25 apart before). 2 ranks of 16 train as one process of 32 with Adam, on the
    fit path and the Task path."""
    outcomes, out, _ = two
    for name in ("embed_adam", "task_embed_adam"):
        assert all("error" not in o and "crash" not in o for o in outcomes[name]), outcomes[name]
        res = result(out / name)
        assert res["ranks_identical"] is True and res["global_step"] == 2 * 256 // 32, res
        one_dir = str(tmp_path / name)
        getattr(scenarios, name)(one_dir, batch_size=32)
        assert result(one_dir)["global_batch_size"] == res["global_batch_size"] == 32
        apart = max(
            float(np.abs(a - b).max()) for a, b in zip(weights(out / name), weights(one_dir))
        )
        assert apart < 1e-5, (name, apart)


def test_a_train_step_that_updates_a_weight_by_hand_stops_before_its_first_checkpoint(two):
    """A model's own train_step moves a bias by hand, each rank by its own batch: the ranks'
    models part, and the first checkpoint (epoch 1's end, step 8) finds it: one line naming
    the ranks and the cause, exit 1, nothing saved for one model that is really two."""
    outcomes, out, _ = two
    for o in outcomes["drifting"]:
        assert (o.get("type"), o.get("status")) == ("RanksDiffer", 1), o
        assert o["error"].startswith(
            "the model of rank(s) [1] differs from rank 0's at "
            "step 8 (weights or layers' state): something changed "
            "it outside the distributed optimizer"
        ), o["error"]
        assert o["error"].endswith("training stopped (no checkpoint was saved before it)")
        assert "\n" not in o["error"]
    assert not (out / "drifting" / "result.json").exists()
    assert not list((out / "drifting").glob("checkpoints/ckpt-*"))
