"""Fault tolerance, for real: SIGKILL and resume, SIGTERM, corrupt checkpoints, dead and
frozen peers under Gloo and MPI. Each test bounds its processes and kills what it started."""

import json
import os
import signal
import time

import numpy as np
import pytest

from conftest import (
    LINEAR,
    LINEAR_EPOCHS,
    Lazy,
    checkpoints,
    finish,
    kill_after_first_checkpoint,
    launch,
    module_cmd,
    rank_pids,
    result,
    run,
    running,
    start,
    wait_for,
)
from hvdtrain.engine import checkpoint_file as C

MNIST = [
    "--batch-size",
    "20",
    "--epochs",
    "5",
    "--learning-rate",
    "0.5",
    "--no-download",
    "--checkpoint-every",
    "50",
    "--verbose",
    "0",
]


@pytest.fixture(scope="module")
def reference(references):
    """Uninterrupted two-process runs of both tasks (the session's shared references), each
    launched when a test first reads it."""
    args = {"linear": LINEAR, "mnist": MNIST}
    return Lazy(lambda task: references.run("gloo", 2, task, *args[task]))


# The linear task's SIGKILL at an epoch's end and rerun is test_resume_edges' (both paths,
# both kinds of checkpoint, with this test's checks). Keras 3 only: the Task path's SIGKILL and
# rerun under Keras 2 is test_examples' conv resume (SIGTERM) and test_resume_edges' fit path.
def test_mnist_sigkill_then_resume_is_exact(reference, env, tmp_path):
    cmd = launch("gloo", 2, "mnist", "--run-dir", str(tmp_path), *MNIST)
    kill_after_first_checkpoint(cmd, env, tmp_path)
    p = run(cmd, env)
    assert p.returncode == 0, p.stderr
    assert "hvdtrain: resumed from" in p.stderr, p.stderr
    r, ref = result(tmp_path), reference["mnist"]
    assert r["global_step"] == ref["global_step"] == 5 * 4000 // 40
    assert r["test_accuracy"] == ref["test_accuracy"]
    assert abs(r["final_loss"] - ref["final_loss"]) < 1e-6


# Keras 3 only: the stop (every rank at one step, one line, the checkpoint at that step) is
# hvdtrain's loop under either Keras; what Keras 2 changes, its optimizer's state saved and
# restored across a SIGTERM to one rank, is test_examples.py's conv resume under Keras 2
# (bit-identical weights).
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_sigterm_to_one_rank_stops_all_at_a_step_and_resumes_exactly(
    launcher, reference, env, tmp_path
):
    cmd = launch(launcher, 2, "linear", "--run-dir", str(tmp_path), *LINEAR)
    proc = start(cmd, env)
    try:
        pids = wait_for(
            lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(str(tmp_path))), 60
        )
        assert pids and wait_for(lambda: checkpoints(tmp_path), 60)
        sent = time.monotonic()
        os.kill(pids[1], signal.SIGTERM)
        rc, out, err = finish(proc, 30)
        assert rc is not None, "the job did not end within 30 s of SIGTERM"
        assert wait_for(
            lambda: not any(running(p) for p in pids.values()), 30 - (time.monotonic() - sent)
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0
    message = [l for l in err.splitlines() if "stopped by SIGTERM at step" in l]
    assert len(message) == 1, err
    stopped_at = int(message[0].split("at step ")[1].split(";")[0])
    assert checkpoints(tmp_path)[0][0] == stopped_at  # saved at the step boundary itself
    assert not (tmp_path / "result.json").exists()
    p = run(cmd, env)
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert r["global_step"] == reference["linear"]["global_step"]
    np.testing.assert_allclose(r["weights"], reference["linear"]["weights"], atol=1e-6)


@pytest.mark.parametrize("to", ["rank 0", "mpirun"])
def test_sigint_is_a_preemption_like_sigterm(to, reference, env, tmp_path):
    """Ctrl-C: SIGINT to a rank stops every rank at a shared step with a checkpoint and exit
    75, and the rerun ends as the uninterrupted run; SIGINT to mpirun itself (a terminal's
    Ctrl-C reaches mpirun alone: the ranks have process groups of their own) is forwarded
    as SIGTERM, the ranks do the same, and mpirun exits 1, its own status when interrupted."""
    # mpirun takes about 2 s to pass its SIGINT on: a job that lasts longer than that.
    args = LINEAR if to == "rank 0" else [*LINEAR[:2], "--epochs", "40", *LINEAR[4:]]
    cmd = launch("mpirun", 2, "linear", "--run-dir", str(tmp_path), *args)
    proc = start(cmd, env)
    try:
        pids = wait_for(
            lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(str(tmp_path))), 60
        )
        assert pids and wait_for(lambda: checkpoints(tmp_path), 60)
        os.kill(pids[0] if to == "rank 0" else proc.pid, signal.SIGINT)
        rc, out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = "SIGINT" if to == "rank 0" else "SIGTERM"
    stopped = [l for l in (out + err).splitlines() if "stopped by" in l]
    assert len(stopped) == 1 and f"stopped by {said} at step " in stopped[0], err[-3000:]
    assert rc == (75 if to == "rank 0" else 1), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert checkpoints(tmp_path)[0][0] == step  # saved at the step boundary itself
    assert not (tmp_path / "result.json").exists()
    if to == "rank 0":
        p = run(cmd, env)
        assert p.returncode == 0, p.stderr
        r = result(tmp_path)
        assert r["global_step"] == reference["linear"]["global_step"]
        np.testing.assert_allclose(r["weights"], reference["linear"]["weights"], atol=1e-6)


def test_truncated_latest_checkpoint_falls_back_then_all_corrupt_fails(env, tmp_path):
    args = ["--batch-size", "10", "--epochs", "2", "--checkpoint-every", "20", "--verbose", "2"]
    first = run(module_cmd("linear", "--run-dir", str(tmp_path), *args), env)
    assert first.returncode == 0, first.stderr
    found = checkpoints(tmp_path)
    assert [s for s, _ in found] == [200, 180, 160]  # keep 3, newest first
    newest, previous = found[0][1], found[1][1]
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    again = run(
        module_cmd("linear", "--run-dir", str(tmp_path), "--epochs", "3", *args[:2], *args[4:]), env
    )
    assert again.returncode == 0, again.stderr
    warning = [l for l in again.stderr.splitlines() if "warning:" in l and "truncated:" in l]
    assert len(warning) == 1 and os.path.basename(previous) in warning[0], again.stderr
    assert f"resumed from {previous}" in again.stderr
    assert result(tmp_path)["global_step"] == 300  # 180 + the rest: resumed, not restarted

    for _, path in checkpoints(tmp_path):  # now break every one, in different ways
        raw = bytearray(open(path, "rb").read())
        raw[-10] ^= 0xFF
        open(path, "wb").write(bytes(raw))
    bad = run(
        module_cmd("linear", "--run-dir", str(tmp_path), "--epochs", "4", *args[:2], *args[4:]), env
    )
    assert bad.returncode == 1
    errors = [l for l in bad.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "no valid checkpoint" in errors[0], bad.stderr
    assert "checksum mismatch" in errors[0] and "Traceback" not in bad.stderr


def test_resume_refuses_other_settings_and_honours_flags(env, tmp_path):
    args = ["--epochs", "1", "--verbose", "0"]
    assert run(module_cmd("linear", "--run-dir", str(tmp_path), *args), env).returncode == 0
    p = run(module_cmd("linear", "--run-dir", str(tmp_path), "--learning-rate", "0.1", *args), env)
    assert p.returncode == 1 and "--learning-rate 0.5 -> 0.1" in p.stderr, p.stderr
    p = run(module_cmd("linear", "--run-dir", str(tmp_path), "--no-resume", *args), env)
    assert p.returncode == 1 and "--no-resume" in p.stderr
    p = run(module_cmd("linear", "--run-dir", str(tmp_path / "new"), "--resume", *args), env)
    assert p.returncode == 1 and "--resume: no checkpoint" in p.stderr


def test_resume_compares_the_tasks_own_settings_but_not_per_rank_ones(env, tmp_path):
    args = [
        "--run-dir",
        str(tmp_path),
        "--epochs",
        "1",
        "--verbose",
        "0",
        "--model",
        "mlp",
        "--no-download",
    ]
    assert run(module_cmd("mnist", *args, "--hidden-units", "8"), env).returncode == 0
    p = run(module_cmd("mnist", *args, "--hidden-units", "16"), env)
    assert p.returncode == 1 and "--hidden-units 8 -> 16" in p.stderr, p.stderr
    # --download is per rank and does not define the run: the same run continues.
    p = run(
        module_cmd("mnist", *args[:-1], "--hidden-units", "8", "--epochs", "2", "--download"), env
    )
    assert p.returncode == 0 and "resumed from" in p.stderr, p.stderr


def test_resume_with_another_world_size(env, tmp_path):
    """Two workers killed mid-epoch, one worker resumes: same epochs, examples not repeated."""
    cmd = launch("gloo", 2, "linear", "--run-dir", str(tmp_path), *LINEAR)
    kill_after_first_checkpoint(cmd, env, tmp_path)
    meta, _ = C.read(checkpoints(tmp_path)[0][1])
    p = run(module_cmd("linear", "--run-dir", str(tmp_path), *LINEAR), env)
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert r["world_size"] == 1 and r["global_batch_size"] == 5
    # The epoch in progress continues after the same examples: 2 x 5 per old step.
    done = meta["step_in_epoch"] * 10
    steps_left = (1000 - done) // 5 + (LINEAR_EPOCHS - meta["epoch"] - 1) * 200
    assert r["global_step"] == meta["global_step"] + steps_left


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dead_or_frozen_rank_ends_the_job_naming_it(launcher, how, env, tmp_path):
    timeout = 8
    cmd = launch(
        launcher,
        2,
        "linear",
        "--run-dir",
        str(tmp_path),
        "--batch-size",
        "5",
        "--epochs",
        "200",
        "--peer-timeout",
        str(timeout),
        "--verbose",
        "0",
    )
    proc = start(cmd, env)
    pids = {}
    try:
        pids = wait_for(
            lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(str(tmp_path))), 60
        )
        assert pids and wait_for(lambda: checkpoints(tmp_path), 60)
        sent = time.monotonic()
        os.kill(pids[1], getattr(signal, how))
        # The bound: the peer timeout, plus the heartbeat interval and scheduling slack.
        survivor = pids[0]
        assert wait_for(lambda: not running(survivor), timeout + 10)
        elapsed = time.monotonic() - sent
        rc, out, err = finish(proc, 30)
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc not in (None, 0)
    assert elapsed < (2 if how == "SIGKILL" else timeout + 5)
    verdict = [l for l in err.splitlines() if "hvdtrain: error: rank 1" in l]
    assert verdict, err
    assert f"pid {pids[1]}" in verdict[0]
    assert ("died" if how == "SIGKILL" else "stopped answering") in verdict[0]


@pytest.mark.quick
def test_checkpoint_file_checks(tmp_path):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0])]
    meta = {"global_step": 5, "epoch": 0}
    path = C.save(str(tmp_path), arrays, ["w", "b"], meta, keep=2)
    got, back = C.read(path)
    assert got["global_step"] == 5 and got["variables"] == [
        ["w", [2, 3], "float32"],
        ["b", [1], "float64"],
    ]
    np.testing.assert_array_equal(back[0], arrays[0])
    for step in (6, 7):
        C.save(str(tmp_path), arrays, ["w", "b"], dict(meta, global_step=step), keep=2)
    assert [s for s, _ in C.list_checkpoints(str(tmp_path))] == [7, 6]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    open(tmp_path / "ckpt-000000008.hvdt", "wb").write(b"HVDTCKPT")
    warnings = []
    meta8, _, used = C.load_latest(str(tmp_path), warnings.append)
    assert meta8["global_step"] == 7 and "bad header" in warnings[0]


@pytest.mark.parametrize("where", ["epoch", "global_step", "payload", "trailer", "version"])
@pytest.mark.quick
def test_every_byte_of_a_checkpoint_is_covered(tmp_path, where):
    """One flipped bit anywhere (metadata included) is detected; the one before is used."""
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0])]
    meta = {"global_step": 5, "epoch": 1, "offset": 30}
    older = C.save(str(tmp_path), arrays, ["w", "b"], meta, keep=3)
    newest = C.save(str(tmp_path), arrays, ["w", "b"], dict(meta, global_step=6), keep=3)
    raw = bytearray(open(newest, "rb").read())
    at = {
        "epoch": raw.index(b'"epoch": 1') + len(b'"epoch": '),
        "global_step": raw.index(b'"global_step": 6') + len(b'"global_step": '),
        "payload": len(raw) - 100,
        "trailer": len(raw) - 1,
        "version": 8,
    }[where]
    raw[at] ^= 0x01  # "1" -> "0", "6" -> "7": still valid JSON, a silently wrong position
    open(newest, "wb").write(bytes(raw))
    with pytest.raises(C.CheckpointError, match="checksum mismatch|format version"):
        C.read(newest)
    warnings = []
    got, _, used = C.load_latest(str(tmp_path), warnings.append)
    assert used == older and got["global_step"] == 5 and len(warnings) == 1


def _forge(directory, step, meta, members):
    """A checkpoint made by hand: its hash matches, its contents are whatever ``members``
    (npz member name: raw .npy bytes) and ``meta`` say. Returns its path."""
    import hashlib
    import io
    import struct
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, raw in members.items():
            z.writestr(name, raw)
    payload = buf.getvalue()
    header = json.dumps(dict(meta, payload_bytes=len(payload)), sort_keys=True).encode()
    body = C.MAGIC + bytes([C.VERSION]) + struct.pack(">Q", len(header)) + header + payload
    path = C.path_for(str(directory), step)
    with open(path, "wb") as f:
        f.write(body + hashlib.sha256(body).digest())
    return path


def _npy(array=None, header=None, data=b""):
    """The bytes of one .npy member: ``array`` saved, or a ``header`` (shape, dtype) with
    ``data`` after it."""
    import io

    f = io.BytesIO()
    if array is not None:
        np.save(f, array, allow_pickle=True)
        return f.getvalue()
    np.lib.format.write_array_header_1_0(
        f,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(header[1])),
            "fortran_order": False,
            "shape": header[0],
        },
    )
    return f.getvalue() + data


W = np.arange(6, dtype=np.float32).reshape(2, 3)
FORGED = {  # name: (what the line says, the newest checkpoint's metadata and members)
    "4 TB array header": (
        "bytes of data for 4398046511104",
        {"global_step": 9, "variables": [["w", [2**40], "float32"]]},
        {"arr_0.npy": _npy(header=((2**40,), "float32"), data=b"\0" * 16)},
    ),
    "truncated array": (
        "8 bytes of data for 24",
        {"global_step": 9, "variables": [["w", [2, 3], "float32"]]},
        {"arr_0.npy": _npy(W)[:-16]},
    ),
    "missing array": (
        "payload lacks 1 of the 2 arrays (arr_1.npy",
        {"global_step": 9, "variables": [["w", [2, 3], "float32"], ["b", [1], "float32"]]},
        {"arr_0.npy": _npy(W)},
    ),
    "object array": (
        "dtype object is not a number type",
        {"global_step": 9, "variables": [["w", [2], "object"]]},
        {"arr_0.npy": _npy(np.array([{"a": 1}, None], dtype=object))},
    ),
    "array other than its metadata": (
        "array float64[2, 3] where the metadata says float32[2, 3]",
        {"global_step": 9, "variables": [["w", [2, 3], "float32"]]},
        {"arr_0.npy": _npy(W.astype(np.float64))},
    ),
    "negative step": (
        "global_step -5: not a count",
        {"global_step": -5, "variables": [["w", [2, 3], "float32"]]},
        {"arr_0.npy": _npy(W)},
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", list(FORGED))
def test_a_checkpoint_with_a_valid_hash_but_bad_contents_is_skipped(case, tmp_path):
    """A hand-made (or buggy) checkpoint whose sha256 matches is checked against its own
    metadata before anything is allocated, and skipped like a corrupt one."""
    says, meta, members = FORGED[case]
    older = C.save(str(tmp_path), [W], ["w"], {"global_step": 5, "epoch": 1}, keep=3)
    forged = _forge(tmp_path, 9, meta, members)
    with pytest.raises(C.CheckpointError) as e:
        C.read(forged)
    assert says in str(e.value) and "\n" not in str(e.value)
    warnings = []
    got, arrays, used = C.load_latest(str(tmp_path), warnings.append)
    assert used == older and got["global_step"] == 5 and np.array_equal(arrays[0], W)
    assert len(warnings) == 1 and says in warnings[0] and os.path.basename(older) in warnings[0]


def test_a_forged_newest_checkpoint_resumes_from_the_valid_one_and_leftovers_go(env, tmp_path):
    """End to end: a hand-made newest checkpoint (a 4 TB array header, a valid hash) and a
    killed save's temporary file; the rerun warns once, resumes from the checkpoint before,
    ends as a run that was never interrupted would, and removes the temporary file."""
    args = ["--batch-size", "10", "--checkpoint-every", "20", "--verbose", "2"]
    first = run(
        module_cmd("linear", "--run-dir", str(tmp_path / "run"), "--epochs", "2", *args), env
    )
    assert first.returncode == 0, first.stderr
    directory = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in checkpoints(tmp_path / "run")] == [200, 180, 160]
    saved, _ = C.read(C.path_for(str(directory), 200))
    says, meta, members = FORGED["4 TB array header"]
    _forge(directory, 210, {**saved, **meta, "global_step": 210}, members)
    leftover = directory / ".ckpt-000000220.hvdt.k1ll3d.tmp"  # a save killed before its rename
    leftover.write_bytes(b"\0" * 1000)
    again = run(
        module_cmd("linear", "--run-dir", str(tmp_path / "run"), "--epochs", "3", *args), env
    )
    assert again.returncode == 0, again.stderr
    warning = [l for l in again.stderr.splitlines() if "warning:" in l and says in l]
    assert len(warning) == 1 and "ckpt-000000200.hvdt instead" in warning[0], again.stderr
    assert "Traceback" not in again.stderr and not leftover.exists()
    ref = run(module_cmd("linear", "--run-dir", str(tmp_path / "ref"), "--epochs", "3", *args), env)
    assert ref.returncode == 0, ref.stderr
    r, uninterrupted = result(tmp_path / "run"), result(tmp_path / "ref")
    assert r["global_step"] == uninterrupted["global_step"] == 300
    assert r["weights_sha256"] == uninterrupted["weights_sha256"]
