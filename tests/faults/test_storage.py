"""Storage failures at a save, for real: a disk that fills up (a small tmpfs), a file system
that turns read-only, a file where the run's checkpoints/ folder belongs. Each is one line
naming the file and the OS's reason, exit 1, the checkpoints before it valid, no temporary
file left; the rerun resumes and ends as an uninterrupted run.

The tmpfs lives in a private mount namespace (``unshare -m``, as root: CI's and the
containers' user) held by one process; the tests run their commands in it (``nsenter``), and
everything goes when that process is killed: nothing on the machine is mounted or changed."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import (
    HOROVODRUN,
    ROOT,
    checkpoints,
    finish,
    launch,
    launch_example,
    result,
    run,
    script_cmd,
    start,
    wait_for,
)
from hvdtrain.engine import checkpoint_file as C

# test_faults.py's uninterrupted two-process linear run: the session's shared reference.
LINEAR = [
    "--batch-size",
    "5",
    "--epochs",
    "10",
    "--learning-rate",
    "0.0005",
    "--checkpoint-every",
    "100",
    "--verbose",
    "0",
]
NO_SPACE = "[Errno 28] No space left on device"


class Tmpfs:
    """A tmpfs of ``size`` at ``path``, seen only by the commands given to ``inside``."""

    def __init__(self, path, size):
        self.path = str(path)
        os.makedirs(self.path, exist_ok=True)
        script = (
            f"mount --make-rprivate / && mount -t tmpfs -o size={size} none {self.path}"
            " && echo ready && exec sleep 900"
        )
        self.holder = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if self.holder.stdout.readline().strip() != "ready":
            self.holder.kill()
            pytest.skip(f"no private tmpfs here: {self.holder.communicate()[1].strip()}")

    def inside(self, cmd):
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", *map(str, cmd)]

    def seen(self, path):
        """``path`` (under the tmpfs) as this process can read it."""
        return f"/proc/{self.holder.pid}/root{os.path.abspath(path)}"

    def fill(self):
        subprocess.run(
            self.inside(["sh", "-c", f"cat /dev/zero > {self.path}/fill"]), capture_output=True
        )

    def free(self):
        subprocess.run(self.inside(["rm", "-f", f"{self.path}/fill"]), check=True)

    def read_only(self, path):
        """``path`` read-only from now on: a read-only bind mount over it (the files the run
        holds open keep their own mount, as they would on a file system remounted under it)."""
        subprocess.run(
            self.inside(
                ["sh", "-c", f"mount --bind {path} {path} && mount -o remount,bind,ro {path}"]
            ),
            check=True,
        )

    def writable(self, path):
        subprocess.run(self.inside(["umount", path]), check=True)

    def close(self):
        os.killpg(self.holder.pid, signal.SIGKILL)  # the namespace and its tmpfs go with it
        self.holder.communicate()


@pytest.fixture
def tmpfs(tmp_path):
    disk = Tmpfs(tmp_path / "disk", "8m")
    yield disk
    disk.close()


def lines_with(text, p_or_err):
    err = p_or_err if isinstance(p_or_err, str) else p_or_err.stdout + p_or_err.stderr
    return [l for l in err.splitlines() if text in l]


# The fit path: the Keras example's dense model, 2 ranks, 3 epochs of 125 steps, a checkpoint
# every 30 steps.
FIT = [
    "--model",
    "dense",
    "--epochs",
    "3",
    "--batch-size",
    "16",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--checkpoint-every",
    "30",
]


@pytest.fixture(scope="module")
def fit_whole(tmp_path_factory):
    """The fit path's uninterrupted run (FIT, 2 ranks): the tests' reference."""
    from conftest import clean_env

    base = tmp_path_factory.mktemp("fit_whole")
    p = run(
        launch_example(2, "keras_fit_mnist.py", "--run-dir", base / "whole", *FIT),
        clean_env(base / "home"),
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return result(base / "whole")


READ_ONLY = "[Errno 30] Read-only file system"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["full", "read-only"])
@pytest.mark.parametrize("path", ["task", "fit"])
def test_a_full_disk_mid_run_is_one_line_and_the_rerun_resumes_exactly(
    path, kind, tmpfs, references, fit_whole, env
):
    """The disk fills, or the run directory turns read-only, after the first checkpoint, on
    both paths: one line (rank 0's, naming the file it could not write), exit 1, the
    checkpoints before it whole, no temporary file; with room again (writable again) the
    same command resumes and ends as the uninterrupted run."""
    run_dir = f"{tmpfs.path}/run"
    if path == "task":
        ref = references.run("gloo", 2, "linear", *LINEAR)
        cmd = tmpfs.inside(launch("gloo", 2, "linear", "--run-dir", run_dir, *LINEAR))
    else:
        ref = fit_whole
        cmd = tmpfs.inside(launch_example(2, "keras_fit_mnist.py", "--run-dir", run_dir, *FIT))
    proc = start(cmd, env)
    try:
        assert wait_for(lambda: checkpoints(tmpfs.seen(run_dir)), 120), "no checkpoint"
        if kind == "full":
            tmpfs.fill()
        else:
            tmpfs.read_only(run_dir)
        rc, out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 1, err[-3000:]
    why = NO_SPACE if kind == "full" else READ_ONLY
    said = lines_with(why, out + err)
    assert len(said) == 1 and "Traceback" not in "\n".join(
        l for l in err.splitlines() if "<stderr>" in l
    ), err[-3000:]
    # rank 0's line: the file it could not write (a checkpoint, metrics.jsonl or TensorBoard's)
    assert re.search(
        rf"error: cannot write {re.escape(run_dir)}/\S+: "
        rf"{re.escape(why)}$",
        said[0],
    ), said
    seen = tmpfs.seen(run_dir)
    kept = checkpoints(seen)
    assert kept and C.read(kept[0][1])  # the checkpoints before it are whole
    leftovers = [
        n
        for d in (seen, f"{seen}/checkpoints")
        for n in os.listdir(d)
        if n.startswith(".") and n != ".lock"
    ]
    assert not leftovers
    assert not os.path.exists(f"{seen}/result.json")
    if kind == "full":
        tmpfs.free()
    else:
        tmpfs.writable(run_dir)
    again = run(cmd, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {kept[0][1].replace(seen, run_dir)}" in again.stdout + again.stderr
    r = result(seen)
    assert r["global_step"] == ref["global_step"]
    assert r["weights_sha256"] == ref["weights_sha256"]  # nothing lost


# The disk fills when training has ended, before model.keras: rank 0, when the test has put
# FILL_FLAG there. The Task path: the linear task (its name, so its weights are the shared
# reference's) filling in its summarize; the fit path: the Keras example unchanged, hk.fit given
# one more callback, filling in on_train_end.
FULL_AT_END = textwrap.dedent("""
    import os
    import subprocess

    from hvdtrain.tasks.linear import LinearTask


    def fill():
        import horovod.tensorflow as hvd

        flag = os.environ["FILL_FLAG"]
        if hvd.rank() == 0 and os.path.exists(flag):
            subprocess.run(["sh", "-c", f"cat /dev/zero > {os.path.dirname(flag)}/fill"],
                           capture_output=True)


    class FullAtEnd(LinearTask):
        def summarize(self, model):
            fill()
            return super().summarize(model)
""")
FIT_FULL_AT_END = textwrap.dedent("""
    import runpy
    import sys

    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    import fullatend

    real = hk.fit


    class Fill(keras().callbacks.Callback):
        def on_train_end(self, logs=None):
            fullatend.fill()


    def fit(*args, callbacks=(), **kwargs):
        return real(*args, callbacks=[*callbacks, Fill()], **kwargs)


    hk.fit = fit
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["task", "fit"])
def test_a_full_disk_at_model_keras_is_one_line_and_the_rerun_writes_it(
    path, tmpfs, references, fit_whole, env, tmp_path
):
    """2 ranks, both paths: the disk full after the last epoch's checkpoint, at model.keras:
    rank 0's one line naming it, exit 1, the last checkpoint whole, no temporary file, no
    result.json; with room again the same command trains nothing and writes the model and the
    result of the uninterrupted run."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "fullatend.py").write_text(FULL_AT_END)
    (code / "fit_full_at_end.py").write_text(FIT_FULL_AT_END)
    flag = f"{tmpfs.path}/FILL"
    env = dict(env, PYTHONPATH=f"{code}{os.pathsep}{env['PYTHONPATH']}", FILL_FLAG=flag)
    run_dir = f"{tmpfs.path}/run"
    if path == "task":
        ref = references.run("gloo", 2, "linear", *LINEAR)
        cmd = [
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            sys.executable,
            "-m",
            "hvdtrain",
            "run",
            "fullatend:FullAtEnd",
            "--run-dir",
            run_dir,
            *LINEAR,
        ]
    else:
        ref = fit_whole
        cmd = script_cmd(
            2,
            code / "fit_full_at_end.py",
            os.path.join(ROOT, "examples", "keras_fit_mnist.py"),
            "--run-dir",
            run_dir,
            *FIT,
        )
    open(tmpfs.seen(flag), "w").close()
    p = run(tmpfs.inside(cmd), env, timeout=180)
    assert p.returncode == 1, p.stderr[-3000:]
    said = lines_with(NO_SPACE, p)
    assert len(said) == 1, p.stderr[-3000:]
    assert said[0].endswith(f"error: cannot write {run_dir}/model.keras: {NO_SPACE}"), said
    assert "Traceback" not in "\n".join(l for l in p.stderr.splitlines() if "<stderr>" in l)
    seen = tmpfs.seen(run_dir)
    kept = checkpoints(seen)
    assert kept[0][0] == ref["global_step"] and C.read(kept[0][1])  # the last, whole
    leftovers = [
        n
        for d in (seen, f"{seen}/checkpoints")
        for n in os.listdir(d)
        if n.startswith(".") and n != ".lock"
    ]
    assert not leftovers
    assert not os.path.exists(f"{seen}/result.json") and not os.path.exists(f"{seen}/model.keras")
    tmpfs.free()
    os.remove(tmpfs.seen(flag))
    again = run(tmpfs.inside(cmd), env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {kept[0][1].replace(seen, run_dir)}" in again.stdout + again.stderr
    r = result(seen)
    assert r["global_step"] == ref["global_step"]
    assert r["weights_sha256"] == ref["weights_sha256"]  # nothing lost
    assert r["model"] == f"{run_dir}/model.keras" and os.path.getsize(f"{seen}/model.keras") > 0


# Each save site of the run directory, in one process (no launcher is being tested here):
# hvdtrain's own Reporter and checkpoint writer, with a disk that is full, then read-only.
SITES = textwrap.dedent("""
    import json, os, subprocess, sys
    import numpy as np
    from hvdtrain.base import files
    from hvdtrain.engine import checkpoint_file as C, report
    from hvdtrain.engine.rundir import RunDir
    from hvdtrain.compat import keras
    from hvdtrain.distributed import World
    from hvdtrain.base.errors import StorageError

    disk, run_dir = sys.argv[1], sys.argv[2]
    out = report.Reporter(World(), RunDir(run_dir), verbose=0)
    out.claim()
    out.start({"task": "t"})
    ckpts = os.path.join(run_dir, "checkpoints")
    arrays = [np.arange(6, dtype=np.float32)]
    C.save(ckpts, arrays, ["w"], {"global_step": 1, "epoch": 0}, keep=3)
    # metrics.jsonl to a whole page: the next line needs a page of its own
    record = {"epoch": 1, "global_step": 1, "loss": 0.5, "pad": ""}
    record["pad"] = "x" * (4096 - len(json.dumps(record, sort_keys=True)) - 1)
    out.epoch(record)
    k = keras()
    model = k.Sequential([k.Input((3,)), k.layers.Dense(2)])
    said = {}

    def attempt(name, fn, *args):
        try:
            fn(*args)
            said[name] = None
        except StorageError as e:
            said[name] = str(e)

    def sites(kind):
        attempt(kind + " checkpoint", C.save, ckpts, arrays, ["w"],
                {"global_step": 2, "epoch": 0}, 3)
        attempt(kind + " metrics", out.epoch, dict(record, epoch=2, pad=""))
        attempt(kind + " model", out.save_model, model)
        attempt(kind + " result", files.write_json_atomic,
                os.path.join(run_dir, "result.json"), {"done": True})

    subprocess.run(["sh", "-c", f"cat /dev/zero > {disk}/fill"], capture_output=True)
    sites("full")
    os.unlink(f"{disk}/fill")
    # read-only from here on (a bind mount of the run directory: the files the run holds
    # open keep their own mount)
    subprocess.run(["mount", "--bind", run_dir, run_dir], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", run_dir], check=True)
    sites("read-only")
    subprocess.run(["umount", run_dir], check=True)
    os.unlink(os.path.join(ckpts, os.listdir(ckpts)[0]))
    os.rmdir(ckpts)
    open(ckpts, "w").close()  # a file where the folder belongs
    attempt("file checkpoint", C.save, ckpts, arrays, ["w"], {"global_step": 3, "epoch": 0}, 3)
    os.unlink(ckpts)
    C.save(ckpts, arrays, ["w"], {"global_step": 1, "epoch": 0}, keep=3)
    said["files"] = sorted(os.listdir(run_dir)) + sorted(os.listdir(ckpts))
    said["metrics"] = [json.loads(l)["epoch"] for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    print("SAID " + json.dumps(said))
""")


@pytest.mark.timeout(120)
def test_every_save_site_says_the_file_and_the_reason_and_keeps_what_was_there(
    tmpfs, env, tmp_path
):
    (tmp_path / "sites.py").write_text(SITES)
    run_dir = f"{tmpfs.path}/run"
    p = run(
        tmpfs.inside([sys.executable, tmp_path / "sites.py", tmpfs.path, run_dir]), env, timeout=90
    )
    assert p.returncode == 0, p.stderr[-3000:]
    said = json.loads(p.stdout.split("SAID ", 1)[1])
    ro = "[Errno 30] Read-only file system"
    ckpt2 = f"{run_dir}/checkpoints/ckpt-000000002.hvdt"
    assert said == {
        "full checkpoint": f"cannot write {ckpt2}: {NO_SPACE}",
        "full metrics": f"cannot write {run_dir}/metrics.jsonl: {NO_SPACE}",
        "full model": f"cannot write {run_dir}/model.keras: {NO_SPACE}",
        "full result": f"cannot write {run_dir}/result.json: {NO_SPACE}",
        "read-only checkpoint": f"cannot write {ckpt2}: {ro}",
        "read-only metrics": f"cannot write {run_dir}/metrics.jsonl: {ro}",
        "read-only model": f"cannot write {run_dir}/model.keras: {ro}",
        "read-only result": f"cannot write {run_dir}/result.json: {ro}",
        "file checkpoint": (
            f"cannot write {run_dir}/checkpoints/ckpt-000000003.hvdt: [Errno 20] Not a directory"
        ),
        # no temporary file left, the first checkpoint and metrics line kept whole
        "files": [
            ".lock",
            "checkpoints",
            "config.json",
            "metrics.jsonl",
            "tensorboard",
            "ckpt-000000001.hvdt",
        ],
        "metrics": [1],
    }, said
