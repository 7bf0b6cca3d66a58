"""hvdtrain.spark on a local Spark (``local[2]``: the driver's JVM runs both task slots):
a task through ``python -m hvdtrain.spark``, its faults (a rank killed, the driver stopped),
the Python call (a function, a Task, training from a DataFrame written to Parquet), and bad
input. Each rank is a Spark task in which Horovod's Spark integration starts a process, which
starts the rank (hvdtrain.jobs.rank). The namespaced standalone cluster's tests
(tests/clusters/test_spark_cluster.py) run the same front across machines.
"""

import contextlib
import io
import os
import shlex
import shutil
import signal
import socket
import sys

import numpy as np
import pytest

from conftest import (
    LINEAR,
    ROOT,
    TESTS,
    checkpoints,
    clean_env,
    finish,
    lose_after_first_checkpoint,
    rank_pids,
    result,
    run,
    script_cmd,
    start,
    wait_for,
)
from docs_pages import block
from spark_cluster import JAVA_OPTS

pyspark = pytest.importorskip("pyspark")  # the test extra has it (the "spark" extra's pin)
if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
    pytest.skip(
        "no Java (scripts/setup_test.sh installs openjdk-17-jre-headless)", allow_module_level=True
    )

# Keras 3's pass only: the ranks run hvdtrain as under horovodrun, whose Keras 2 runs are
# tested there; Horovod's estimator on Spark is tested under both (test_spark_estimator.py).
pytestmark = pytest.mark.timeout(300)
MASTER = "local[2]"


def driver_env(tmp_path):
    """A driver's environment: this venv's Python for the executors, and the JVM settings of
    the tests' clusters (spark_cluster.JAVA_OPTS: no C2 compiler, one GC thread; half the CPU
    of a driver's start here) through SPARK_CONF_DIR, as a user's spark-defaults.conf."""
    conf = tmp_path / "spark-conf"
    conf.mkdir(exist_ok=True)
    (conf / "spark-defaults.conf").write_text(f"spark.driver.extraJavaOptions {JAVA_OPTS}\n")
    return clean_env(
        tmp_path / "home",
        PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
        PYSPARK_PYTHON=sys.executable,
        SPARK_CONF_DIR=str(conf),
    )


def spark_cmd(*args):
    return [sys.executable, "-m", "hvdtrain.spark", "--master", MASTER, *map(str, args)]


def rank_lines(err, text):
    """The ranks' lines (Horovod's task services put ``[RANK]<stderr>:`` before each)
    holding ``text``, without that prefix."""
    return [l.split(">:", 1)[1] for l in err.splitlines() if ">:" in l and text in l]


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """This pytest's own Spark session (a driver in a notebook, say), stopped at the end."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master(MASTER)
        .appName("hvdtrain-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", JAVA_OPTS)
        .config("spark.local.dir", str(tmp_path_factory.mktemp("spark-local")))
        .getOrCreate()
    )
    yield session
    session.stop()


def test_a_killed_rank_restarts_the_job_which_ends_with_horovodruns_weights(tmp_path, references):
    """The linear task on 2 ranks; rank 1's process SIGKILLed after the first checkpoint:
    one line from the driver, the job starts again and resumes to the weights of the same job
    under horovodrun, uninterrupted."""
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    rc, out, err = lose_after_first_checkpoint(
        spark_cmd("--num-proc", 2, "linear", *LINEAR, "--run-dir", run_dir),
        driver_env(tmp_path),
        run_dir,
        lambda pids: os.kill(pids[1], signal.SIGKILL),
        240,
    )
    assert rc == 0, err[-3000:]
    # The line the Spark page shows, with this host's name.
    (shown,) = block(
        "guides/clusters/spark.md", "hvdtrain.spark: rank 1 on node2 was killed"
    ).text.splitlines()
    said = [l for l in err.splitlines() if l.startswith("hvdtrain.spark: ")]
    here = socket.gethostname()
    placed = f"hvdtrain.spark: 2 ranks: rank 0 on {here}, rank 1 on {here}"
    assert said == [placed, shown.replace("node2", here), placed], err[-3000:]
    assert rank_lines(err + out, "resumed from"), err[-3000:]
    r = result(run_dir)
    assert (r["world_size"], r["global_step"]) == (2, ref["global_step"]), err[-3000:]
    assert r["weights_sha256"] == ref["weights_sha256"], err[-3000:]


def test_sigterm_to_the_driver_saves_and_75_then_the_same_command_resumes(tmp_path, references):
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    cmd = spark_cmd("--num-proc", 2, "linear", *LINEAR, "--run-dir", run_dir)
    proc = start(cmd, driver_env(tmp_path))
    try:
        assert wait_for(lambda: checkpoints(run_dir), 120), "no checkpoint appeared"
        os.kill(proc.pid, signal.SIGTERM)
        rc, out, err = finish(proc, 150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 75, err[-3000:]
    lines = rank_lines(err + out, "stopped by SIGTERM at step")
    assert len(lines) == 1 and lines[0].startswith("python -m hvdtrain.spark linear: "), err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert checkpoints(run_dir)[0][0] == step < ref["global_step"]
    assert not rank_pids(str(run_dir))  # the ranks are gone with it
    p = run(cmd, driver_env(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert rank_lines(p.stderr + p.stdout, "resumed from") and f"step {step}" in p.stdout + p.stderr
    assert result(run_dir)["weights_sha256"] == ref["weights_sha256"]


def test_the_python_call_trains_from_a_dataframe_as_horovodrun_trains_the_arrays(
    spark, tmp_path, monkeypatch, references
):
    """In a process with its own Spark session: a DataFrame written once to Parquet, read by
    each rank, trained with hk.fit on 2 ranks, ends with the weights of the same hk.fit on
    the same arrays under horovodrun -np 2; the page's call trains MNIST as horovodrun does;
    a function that raises on one rank is a SparkJobError of status 1."""
    import hvdtrain.spark
    import ray_train
    import spark_train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, TESTS]))
    with pytest.raises(hvdtrain.spark.SparkJobError) as e:  # before anything starts
        hvdtrain.spark.run("linear", num_proc=2, spark=spark, master="local[1]")
    assert (e.value.status, str(e.value)) == (
        2,
        "master=local[1]: the session given (spark=) "
        "has its own master (local[2]); give one or the "
        "other",
    )
    rows = spark_train.rows()
    df = spark.createDataFrame(rows, ["id", "features", "label"]).repartition(3, "id")
    data = str(tmp_path / "data")
    assert hvdtrain.spark.write_parquet(df.orderBy("id").coalesce(3), data) == data
    read = hvdtrain.spark.read_parquet(data, columns=["features", "label"])
    assert read["features"].shape == (len(rows), 3) and read["label"].shape == (len(rows),)
    np.savez(tmp_path / "data.npz", x=read["features"], y=read["label"])

    got = hvdtrain.spark.run(
        spark_train.fit_from_parquet, args=[data, str(tmp_path / "a")], num_proc=2, spark=spark
    )
    p = run(
        script_cmd(2, os.path.join(TESTS, "spark_train.py"), tmp_path / "data.npz", tmp_path / "b"),
        clean_env(tmp_path / "home", extras=True),  # Spark's pandas and pyarrow
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ref = result(tmp_path / "b")
    assert (got["size"], got["rows"]) == (2, len(rows))
    assert got["data_sum"] == pytest.approx(float(read["features"].sum() + read["label"].sum()))
    assert got["global_step"] == ref["global_step"] == spark_train.EPOCHS * len(rows) // 16
    assert got["weights_sha256"] == ref["weights_sha256"]

    # The page's call, as printed: the session is this process's (the module's).
    code = block("guides/clusters/spark.md", "import hvdtrain.spark").text
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "spark.md", "exec"), {})
    py = result(tmp_path / "runs" / "spark-py")
    assert printed.getvalue().strip().splitlines()[-1] == str(py["test_accuracy"])
    assert (py["world_size"], py["epochs"]) == (2, 1)
    assert (
        py["weights_sha256"]
        == references.run("gloo", 2, "mnist", "--epochs", "1")["weights_sha256"]
    )

    with pytest.raises(hvdtrain.spark.SparkJobError) as e:
        hvdtrain.spark.run(ray_train.fails, args=[1], num_proc=2, spark=spark)
    assert e.value.status == 1


def test_bad_input_is_one_line_before_any_rank_starts(tmp_path):
    env = driver_env(tmp_path)
    cases = [
        (["linear", "--epochs", "0"], 2, "hvdtrain.spark linear: error: --epochs=0: must be"),
        (["nosuchtask"], 2, "'nosuchtask'"),
        (["--num-proc", "0", "linear"], 2, "num_proc=0: must be an integer of at least 1"),
        (["no_such_script.py"], 2, "no_such_script.py: no such script"),
        (
            ["--num-proc", "3", "--start-timeout", "5", "linear"],
            1,
            "Spark did not start 3 tasks for the ranks within 5 s (each rank is one task of one "
            "core; the application has 2 cores now)",
        ),
    ]
    for args, status, said in cases:
        p = run(spark_cmd(*args), env, timeout=120)
        err = [l for l in p.stderr.splitlines() if l.startswith(("hvdtrain", "python -m"))]
        assert p.returncode == status and said in p.stderr, (args, p.returncode, p.stderr)
        assert len(err) == 1, (args, p.stderr)


def test_the_pages_dataframe_driver_runs_as_printed_under_spark_submit(tmp_path):
    """The Spark page's driver, saved as spark_fit.py, under its spark-submit line (the
    master local): it writes the DataFrame, trains on 2 ranks and prints a loss near 0."""
    code = block("guides/clusters/spark.md", '"""Train on a DataFrame with hvdtrain.spark').text
    (tmp_path / "spark_fit.py").write_text(code)
    (line,) = block("guides/clusters/spark.md", "spark-submit --master").commands()
    argv = shlex.split(line.replace("spark://HEAD:7077", MASTER).replace("/shared", str(tmp_path)))
    argv[0] = os.path.join(os.path.dirname(sys.executable), argv[0])
    p = run(argv, driver_env(tmp_path), timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    loss = float(p.stdout.split("final loss ")[1].split()[0])
    assert loss < 0.01, p.stdout[-2000:]
    r = result(tmp_path / "runs" / "fit")
    assert (r["world_size"], r["epochs"]) == (2, 5), r
