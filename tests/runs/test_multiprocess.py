"""Two processes through the real launchers: horovodrun (Gloo, MPI) and plain mpirun."""

import json
import os
import re

import numpy as np
import pytest

from conftest import as_printed, checkout_like, default_run_dirs, keras_flavour, launch, result, run
from docs_pages import block

SEED = [0.1, 0.2, 0.3]


# Under Keras 2 through one launcher: the launcher is not what Keras 2 changes.
@pytest.mark.parametrize(
    "launcher",
    [pytest.param("gloo", marks=[pytest.mark.keras2, pytest.mark.quick]), "mpi", "mpirun"],
)
def test_linear_two_workers_learn_the_seed_weights(launcher, env, tmp_path):
    p = run(launch(launcher, 2, "linear", "--run-dir", str(tmp_path)), env)
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert (r["world_size"], r["backend"], r["global_step"]) == (2, "horovod", 10)
    assert r["keras"].split()[0] == keras_flavour() and r["ranks_identical"] is True
    np.testing.assert_allclose(r["weights"], SEED, atol=1e-3)
    assert abs(r["bias"] - 0.4) < 1e-3
    assert r["batch_size"] == 500 and r["global_batch_size"] == 1000
    # The seed's output, from rank 0 only.
    lines = [l for l in p.stdout.splitlines() if "Epoch:" in l]
    assert len(lines) == 10 and "Epoch: 10  Step: 10  Loss:" in lines[-1]
    # Each line reached the launcher whole: no tag on a newline of its own (mpirun's
    # "[1,0]<stdout>:" after a line's text).
    assert not any(l.rstrip().endswith("<stdout>:") for l in p.stdout.splitlines()), p.stdout


# Under Keras 2 the unconverged case, the stricter one.
@pytest.mark.parametrize("epochs, lr", [pytest.param(2, 0.1, marks=pytest.mark.keras2), (10, 0.5)])
def test_parity_one_process_and_two(epochs, lr, references):
    """Averaged full-batch gradients over equal shards equal the one-process gradient."""
    args = ["--epochs", str(epochs), "--learning-rate", str(lr)]
    # The session's shared runs: the multi-host and SLURM tests compare against the same.
    a, b = references.run("gloo", 1, "linear", *args), references.run("gloo", 2, "linear", *args)
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["keras"] == b["keras"] and a["keras"].split()[0] == keras_flavour()
    assert b["ranks_identical"] is True  # both ranks' weights hash to the same bytes
    np.testing.assert_allclose(a["weights"], b["weights"], atol=1e-5)
    assert abs(a["bias"] - b["bias"]) < 1e-5
    if epochs == 2:  # not yet converged, so equality is not just both reaching the target
        assert abs(a["weights"][2] - 0.3) > 0.05


def test_mnist_two_workers_on_the_bundled_sample(env, tmp_path):
    p = run(
        launch(
            "gloo",
            2,
            "mnist",
            "--run-dir",
            str(tmp_path),
            "--learning-rate",
            "0.5",
            "--no-download",
        ),
        env,
    )
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert (r["world_size"], r["dataset"], r["test_examples"]) == (2, "mnist_sample", 1000)
    assert r["test_accuracy"] >= 0.85
    assert r["global_step"] == 10 * 4000 // 200
    assert "bundled 5,000-digit sample" in p.stdout and "Test accuracy:" in p.stdout
    metrics = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert len(metrics) == 10


# What rank 0 prints, as horovodrun tags it with MPI underneath (its default).
RANK0 = "[1,0]<stdout>:"
EPOCH = re.compile(
    r"Epoch (\d+)/(\d+)  step (\d+)  loss ([\d.]+)  accuracy ([\d.]+)  "
    r"([\d,]+) samples/s"
)


def sample_differences(sample, stdout, cwd):
    """Where what a run printed differs from an output sample of the docs: the same lines in
    the same order (the sample's "..." line stands for the epochs between; a line ending in
    " ..." for its own end), the same words and counts; the loss to 1e-4 (float sums in
    another order on another CPU), samples/s any count, the run dir the one made in ``cwd``
    (the sample's, any user's path to the same runs/<task>-<time>)."""
    lines = stdout.splitlines()
    if not all(l.startswith(RANK0) for l in lines):  # from rank 0 only
        return [f"not rank 0's: {[l for l in lines if not l.startswith(RANK0)]}"]
    got, want = [l[len(RANK0) :] for l in lines], sample.splitlines()
    cut = want.index("...")
    head, tail = want[:cut], want[cut + 1 :]
    if len(got) < len(head) + len(tail):
        return [f"{len(got)} lines printed:\n" + "\n".join(got)]
    between = got[len(head) : len(got) - len(tail)]
    out = [f"between: {l!r}" for l in between if not EPOCH.fullmatch(l)]
    for w, g in zip(head + tail, got[: len(head)] + got[len(got) - len(tail) :]):
        if w.endswith(" ..."):
            w, g = w[: -len(" ...")], g[: len(w) - len(" ...")]
        if EPOCH.fullmatch(w) and EPOCH.fullmatch(g):
            a, b = EPOCH.fullmatch(w).groups(), EPOCH.fullmatch(g).groups()
            if a[:3] + a[4:5] != b[:3] + b[4:5] or abs(float(a[3]) - float(b[3])) > 1e-4:
                out.append(f"{w!r} printed as {g!r}")
            continue
        path = re.search(r"; run dir (\S+)$", w)
        if path:  # an absolute path, as printed, to runs/mnist-<time> where the run ran
            mine = re.escape(os.path.join(str(cwd), "runs", "")) + r"mnist-\d{8}-\d{6}"
            if not (
                re.fullmatch(r"/.+/runs/mnist-\d{8}-\d{6}", path.group(1))
                and g.startswith(w[: path.start(1)])
                and re.fullmatch(mine, g[path.start(1) :])
            ):
                out.append(f"{w!r} printed as {g!r}")
            continue
        if w != g:
            out.append(f"{w!r} printed as {g!r}")
    return out


def test_the_readme_run_commands_as_printed(references, env, tmp_path):
    """The README's Run commands, each run as printed where no MNIST is and there is no
    network, and what the first prints: the README's output sample (and getting-started's,
    the same text: tests/unit/test_docs.py). The two-process run is the session's shared
    one, which the two-host runs (tests/clusters/test_multihost.py) must reproduce."""
    two, one = block("README.md", "horovodrun -np 2 python -m hvdtrain.mnist").commands()
    assert (two, one) == ("horovodrun -np 2 python -m hvdtrain.mnist", "python -m hvdtrain.mnist")
    p, cwd = references.printed(two)
    assert p.returncode == 0, p.stderr[-3000:]
    (run_dir,) = default_run_dirs(cwd, "mnist")
    r = result(run_dir)
    assert (r["world_size"], r["dataset"], r["global_step"]) == (2, "mnist_sample", 10 * 20)
    assert r["ranks_identical"] is True and 0.5 < r["test_accuracy"] <= 1.0
    assert f"Test accuracy: {r['test_accuracy']:.4f}" in p.stdout
    sample = block("README.md", "hvdtrain: no MNIST found").text
    wrong = sample_differences(sample, p.stdout, cwd)
    assert not wrong, "\n".join(wrong)
    q = run(as_printed(one), env, cwd=checkout_like(tmp_path / "one"))
    assert q.returncode == 0, q.stderr[-3000:]
    (run_dir,) = default_run_dirs(tmp_path / "one", "mnist")
    r = result(run_dir)
    assert (r["world_size"], r["dataset"], r["global_step"]) == (1, "mnist_sample", 10 * 40)
    assert 0.5 < r["test_accuracy"] <= 1.0 and "mnist on 1 process," in q.stdout


def test_fashion_mnist_full_dataset(env, tmp_path):
    p = run(
        launch(
            "gloo",
            2,
            "mnist",
            "--dataset",
            "fashion_mnist",
            "--epochs",
            "1",
            "--learning-rate",
            "0.1",
            "--run-dir",
            str(tmp_path),
        ),
        env,
    )
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert (r["train_examples"], r["test_examples"], r["dataset"]) == (
        60000,
        10000,
        "fashion_mnist",
    )
    assert r["global_step"] == 300 and r["test_accuracy"] > 0.7


def test_corrupt_data_stops_every_rank_with_one_line(env, tmp_path):
    from idx_files import corrupt, make_idx_dir

    make_idx_dir(tmp_path)
    corrupt(tmp_path / "train-images-idx3-ubyte.gz", "truncate")
    p = run(
        launch("gloo", 2, "mnist", "--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "run")),
        env,
        timeout=120,
    )
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1, p.stderr
    assert "train-images-idx3-ubyte.gz: truncated gzip stream" in errors[0]
    assert "rank 0" in errors[0] and "rank 1" in errors[0]
    assert not (tmp_path / "run").exists()


def test_worker_count_mismatch_warns_once(env, tmp_path):
    p = run(
        launch(
            "gloo", 2, "linear", "--num-workers", "4", "--run-dir", str(tmp_path), "--epochs", "1"
        ),
        env,
    )
    assert p.returncode == 0, p.stderr
    warnings = [l for l in p.stderr.splitlines() if "--num-workers is 4" in l]
    assert len(warnings) == 1 and "world size 2" in warnings[0]
    assert result(tmp_path)["world_size"] == 2
