"""No silent wrong answer, no traceback, nothing lost: bad run directories, a busy or
finished run directory, divergence, a failing step, bad data through the command line; in
one process and under horovodrun -np 2."""
import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from conftest import HOROVODRUN, finish, launch, module_cmd, rank_pids, run, start, wait_for

LONG = ["--batch-size", "5", "--epochs", "40", "--learning-rate", "0.0005", "--verbose", "2",
        "--checkpoint-every", "50"]


def ranks_output(stderr):
    """What the training processes printed: under horovodrun, the lines it tags with a rank
    (its own closing traceback is the launcher's; scripts/launch_local.sh removes it)."""
    tagged = [l for l in stderr.splitlines() if re.match(r"\[\d+\]<stderr>:", l)]
    return "\n".join(tagged) if "horovodrun" in stderr else stderr


def one_error_line(p, *fragments):
    out = ranks_output(p.stderr)
    lines = [l for l in out.splitlines() if "error:" in l]
    assert len(lines) == 1 and "Traceback" not in out, p.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("np_", [1, 2])
@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_unusable_run_dir_is_one_line_before_anything(kind, np_, env, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    run_dir = blocker if kind == "file" else blocker / "run"
    cmd = (module_cmd("mnist", "--run-dir", str(run_dir), "--no-download") if np_ == 1 else
           launch("gloo", 2, "mnist", "--run-dir", str(run_dir), "--no-download"))
    started = time.monotonic()
    p = run(cmd, env, timeout=120)
    assert p.returncode == (2 if np_ == 1 else 1), p.stderr  # horovodrun: 1 for any failure
    why = "is a file, not a directory" if kind == "file" else "which is a file"
    one_error_line(p, f"--run-dir={run_dir}", why)
    assert blocker.read_text() == "not a directory\n"
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("np_", [1, 2])
def test_a_finished_run_is_never_overwritten(np_, env, tmp_path):
    args = ["--run-dir", str(tmp_path), "--epochs", "2", "--checkpoint-every", "0"]
    first = run(module_cmd("linear", *args), env)
    assert first.returncode == 0, first.stderr
    # A finished run whose checkpoints were cleaned up: only its result remains.
    for name in os.listdir(tmp_path / "checkpoints"):
        os.unlink(tmp_path / "checkpoints" / name)
    before = (tmp_path / "result.json").read_bytes()
    again = run(module_cmd("linear", *args) if np_ == 1 else launch("gloo", 2, "linear", *args),
                env)
    assert again.returncode == (2 if np_ == 1 else 1)
    one_error_line(again, "holds a finished run (result.json)", "choose a new one")
    assert (tmp_path / "result.json").read_bytes() == before


def test_a_second_run_on_a_busy_run_dir_is_refused_and_a_killed_one_leaves_no_lock(env,
                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    first = start(launch("gloo", 2, "linear", "--run-dir", str(run_dir), *LONG), env)
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "first run not up"
        second = run(module_cmd("linear", "--run-dir", str(run_dir), *LONG), env, timeout=120)
        assert second.returncode == 1
        line = one_error_line(second, f"{run_dir} is in use by another run (pid ")
        holder = int(line.split("(pid ")[1].split()[0])
        assert holder in rank_pids(str(run_dir)).values()  # rank 0 of the first run
        # The first run is untouched: it goes on and writes its own files only.
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # ... then dies without releasing anything
        finish(first, 30)
    for pid in rank_pids(str(run_dir)).values():
        os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not rank_pids(str(run_dir)), 30)
    assert (run_dir / ".lock").exists()  # the file stays, the lock died with its holder
    again = run(module_cmd("linear", "--run-dir", str(run_dir), *LONG[:-4], "--epochs", "1",
                           "--verbose", "0"), env)
    assert again.returncode == 0, again.stderr  # not blocked by the killed run


@pytest.mark.parametrize("np_", [1, 2])
def test_divergence_stops_with_exit_1_keeping_the_last_good_checkpoint(np_, env, tmp_path):
    # Full-batch GD at learning rate 50 on the linear task: the loss grows by orders of
    # magnitude per step and overflows float32 within a few dozen steps.
    args = ["--run-dir", str(tmp_path), "--learning-rate", "50", "--epochs", "500",
            "--checkpoint-every", "5", "--verbose", "2"]
    p = run(module_cmd("linear", *args) if np_ == 1 else launch("gloo", 2, "linear", *args), env)
    assert p.returncode == 1, p.stderr
    line = one_error_line(p, "the loss became NaN or infinite at step ",
                          "--no-stop-on-divergence")
    step = int(line.split("at step ")[1].split(":")[0])
    assert 1 < step < 500
    assert not (tmp_path / "result.json").exists()
    from hvdtrain.engine import checkpoint as C
    newest = C.list_checkpoints(str(tmp_path / "checkpoints"))[0]
    assert newest[0] < step and f"step {newest[0]}" in line
    meta, arrays = C.read(newest[1])
    assert all(np.isfinite(a).all() for a in arrays)  # the kept checkpoint is a good one
    for l in open(tmp_path / "metrics.jsonl"):  # every line stays valid JSON
        json.loads(l)


def test_training_on_after_divergence_writes_valid_json(env, tmp_path):
    args = ["--run-dir", str(tmp_path), "--learning-rate", "50", "--epochs", "100",
            "--no-stop-on-divergence", "--verbose", "0"]
    p = run(module_cmd("linear", *args), env)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "result.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    r = json.loads(text)
    assert r["final_loss"] is None and r["global_step"] == 100
    for l in open(tmp_path / "metrics.jsonl"):
        json.loads(l)


BAD_LABELS = '''
import numpy as np
import tensorflow as tf
import hvdtrain
from hvdtrain.data import Data


class BadLabels(hvdtrain.Task):
    """A user's classifier whose data holds a label (10) its 10-way output cannot take."""
    name = "bad_labels"
    defaults = dict(batch_size=8, epochs=1)

    def load_data(self, config, world):
        x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
        y = np.arange(64, dtype=np.int32) % 10
        y[40] = 10
        return Data(x, y)

    def build_model(self, config):
        k = hvdtrain.compat.keras()
        return k.Sequential([k.Input((4,)), k.layers.Dense(10)])

    def loss(self, y, pred):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pred)
'''


BAD_MAP = BAD_LABELS + '''

CALLS = [0]


def flaky(x, y):
    """A reader that fails on rank 1 after its first 150 records (the count's, then training's)."""
    CALLS[0] += 1
    if hvdtrain.distributed.current().rank == 1 and CALLS[0] > 150:
        raise ValueError(f"record {CALLS[0]} is unreadable")
    return x, y


class BadMap(BadLabels):
    name = "bad_map"
    defaults = dict(batch_size=8, epochs=3)

    def load_data(self, config, world):
        x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
        y = np.arange(64, dtype=np.int32) % 10
        ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
            lambda a, b: tf.py_function(flaky, [a, b], [tf.float32, tf.int32]))
        return Data(ds.map(lambda a, b: (tf.ensure_shape(a, [4]), tf.ensure_shape(b, []))), None)
'''

FIT_BAD = """
import sys
import numpy as np
import tensorflow as tf
import hvdtrain.keras as hk
from hvdtrain.compat import keras
hk.init()
k = keras()
case, run_dir = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).random((64, 4)).astype("float32")
y = (np.arange(64) % 10).astype("int32")
model = k.Sequential([k.Input((4,)), k.layers.Dense(10)])
model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
              loss=k.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
more = {}
if case == "labels":  # a label the 10-way output cannot take
    y[40] = 10
    train = hk.dataset(x, y, batch_size=8)
else:  # a reader that fails on rank 1 after its first 100 records (the count's, then training's)
    calls = [0]

    def flaky(a, b):
        calls[0] += 1
        if hk.rank() == 1 and calls[0] > 100:
            raise ValueError(f"record {calls[0]} is unreadable")
        return a, b
    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda a, b: tf.py_function(flaky, [a, b], [tf.float32, tf.int32]))
    train = ds.map(lambda a, b: (tf.ensure_shape(a, [4]), tf.ensure_shape(b, []))).batch(8)
    more = dict(sharded=True)
try:
    hk.fit(model, train, epochs=3, run_dir=run_dir, **more)
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


def the_cause_once(p, cause):
    """The one line naming the failed step, its rank and ``cause``, said once in all the
    job's output, no traceback from the ranks; (its step, its rank)."""
    said = [l for l in (p.stdout + p.stderr).splitlines() if cause in l]
    assert len(said) == 1 and "Traceback" not in ranks_output(p.stderr), p.stderr[-3000:]
    assert "Graph execution error" not in p.stderr + p.stdout
    found = re.search(r"error: training step (\d+) failed on rank (\d+): ", said[0])
    assert found, said[0]
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("np_", [1, 2])
def test_a_failing_step_is_one_line_naming_the_rank(np_, env, tmp_path):
    (tmp_path / "bad_labels.py").write_text(BAD_LABELS)
    env = dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}")
    args = ["-m", "hvdtrain", "run", "bad_labels:BadLabels", "--run-dir", str(tmp_path / "r"),
            "--verbose", "0"]
    cmd = [sys.executable, *args] if np_ == 1 else [HOROVODRUN, "-np", "2", "--gloo",
                                                    sys.executable, *args]
    p = run(cmd, env, timeout=120)
    assert p.returncode == 1, p.stderr
    step, rank = the_cause_once(p, "Received a label value of 10 which is outside the valid "
                                   "range of [0, 10).")
    # The step and rank whose batch holds example 40 (the label 10): hvdtrain's data order.
    from hvdtrain.base.config import Config
    from hvdtrain.inputs.data import epoch_plan
    holds = [(k + 1, r) for r in range(np_)
             for k, rows in enumerate(epoch_plan(64, 8, r, np_, Config().seed, 0)) if 40 in rows]
    assert holds == [(step, rank)]
    assert not (tmp_path / "r" / "result.json").exists()


@pytest.mark.parametrize("path,case", [("task", "map"), ("fit", "labels"), ("fit", "map")])
def test_one_ranks_failing_step_names_its_cause_once_on_both_paths(path, case, env, tmp_path):
    """A label out of range, or a tf.data map function that raises, on rank 1 alone: rank 0
    says the op's own message (not "Graph execution error:"), the step and the rank, once."""
    (tmp_path / "bad_map.py").write_text(BAD_MAP)
    (tmp_path / "fit_bad.py").write_text(FIT_BAD)
    env = dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}")
    cmd = ([sys.executable, "-m", "hvdtrain", "run", "bad_map:BadMap", "--verbose", "0",
            "--run-dir"] if path == "task" else [sys.executable, tmp_path / "fit_bad.py", case])
    p = run([HOROVODRUN, "-np", "2", "--gloo", *map(str, cmd), str(tmp_path / "r")], env,
            timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    if case == "map":
        step, rank = the_cause_once(p, "ValueError: record ")
        assert re.search(r"failed on rank 1: ValueError: record \d+ is unreadable \(in the "
                         r"function given to tf.data's map\)$", p.stderr, re.M), p.stderr[-3000:]
    else:
        step, rank = the_cause_once(p, "Received a label value of 10 which is outside")
        from hvdtrain.inputs.data import epoch_plan  # hk.dataset's order: example 40's step and rank
        assert [(k + 1, r) for r in range(2) for k, rows in
                enumerate(epoch_plan(64, 8, r, 2, 0, 0)) if 40 in rows] == [(step, rank)]
    assert rank == 1 and 1 <= step <= 12  # 3 epochs of 4 steps
    assert not (tmp_path / "r" / "result.json").exists()


@pytest.mark.parametrize("np_", [1, 2])
def test_float_images_in_an_npz_are_refused_not_trained(np_, env, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.random((100, 28, 28)),
             y_train=rng.integers(0, 10, 100), x_test=rng.random((20, 28, 28)),
             y_test=rng.integers(0, 10, 20))
    args = ["--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "r"), "--epochs", "1"]
    p = run(module_cmd("mnist", *args) if np_ == 1 else launch("gloo", 2, "mnist", *args), env)
    assert p.returncode == 1
    one_error_line(p, "mnist.npz: x_train are float64", "integers 0-255")
    assert not (tmp_path / "r").exists()


def listening_address(port):
    """The local address a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    import socket as S
    import struct
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            return S.inet_ntoa(struct.pack("<I", int(address, 16)))
    return None


def test_the_watchdog_ignores_a_foreign_process_that_knows_its_port(env, tmp_path):
    """Anyone on the machine can connect to the port; only the job's ranks are heard."""
    import socket as S
    with S.socket() as probe:  # a free port, given to the watchdog so that the test knows it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    proc = start(launch("gloo", 2, "linear", "--run-dir", str(run_dir), *LONG[:-2]),
                 dict(env, HVDTRAIN_WATCHDOG_PORT=str(port)))
    held = []
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "job did not start"
        assert listening_address(port) in (None, "127.0.0.1")  # one host: loopback only
        forged = [
            # hvdtrain 0.1's protocol: a rank's hello, then the message that stops the job
            b"HELLO 1 4242 attacker\nFAIL rank 1 failed: forged\n",
            # the current protocol with a guessed MAC, then the verdict rank 0 would relay
            b"HELLO 1 4242 attacker " + b"0" * 32 + b" " + b"f" * 64 + b"\nABORT forged\n",
            b"ABORT forged\nBYE\n",
        ]
        challenged = 0
        for payload in forged:
            s = S.create_connection(("127.0.0.1", port), timeout=5)  # open all run long
            held.append(s)
            challenged += s.recv(100).startswith(b"CHALLENGE ")
            s.sendall(payload)
        # ... and one that connects and says nothing, holding its connection open.
        held.append(S.create_connection(("127.0.0.1", port), timeout=5))
        rc, out, err = finish(proc, 240)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc, 30)
    assert rc == 0, err[-3000:]
    assert challenged == len(forged)  # each attempt reached the handshake ...
    # ... and failed: the first refusal in a line at once, the rest counted in one more line
    # at the end (at most one line a minute); the silent one among them if its handshake's
    # 10 s ran out before the job's end
    refusals = [l for l in err.splitlines() if "watchdog: refused" in l]
    assert ("hvdtrain: warning: watchdog: refused a connection from 127.0.0.1: not a rank of "
            "this job (the next such line in 60 s at the earliest)") in refusals[0], refusals
    counted = [int(m) for l in refusals for m in re.findall(r"refused (\d+) connections", l)]
    assert len(refusals) <= 2 and 1 + sum(counted) in (len(forged), len(forged) + 1), refusals
    assert "forged" not in err, err[-3000:]
    assert json.load(open(run_dir / "result.json"))["ranks_identical"] is True


def _rss_mb(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024


class PeakMemory:
    """Rank 0's peak resident memory (VmHWM, MB) over a job's life: read every 0.1 s from
    the moment the rank is found until ``close()`` (after the job's end: its last reading)."""

    def __init__(self, run_dir):
        import threading

        self.mb, self.done = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(str(run_dir),), daemon=True)
        self.thread.start()

    def _watch(self, run_dir):
        pid = None
        while not self.done.is_set():
            pid = pid or rank_pids(run_dir).get(0)
            if pid:
                try:
                    self.mb = max(self.mb, _rss_mb(pid, "VmHWM"))
                except (OSError, StopIteration):  # it has ended
                    return
            self.done.wait(0.1)

    def close(self):
        self.done.set()
        self.thread.join(10)
        return self.mb


def test_the_watchdog_holds_against_a_flood_and_a_line_without_end(env, tmp_path):
    """100 MB sent without a newline, then 500 connections: rank 0's memory does not grow by
    what was sent (its peak within 50 MB of the same job's in quiet), the job ends with its
    normal result, and a few lines say what happened."""
    import socket as S
    import threading
    with S.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    # Long enough for the attack (a few seconds) on a slow machine: 2.5 times LONG's epochs.
    args = [*LONG[:LONG.index("--epochs") + 1], "100", *LONG[LONG.index("--epochs") + 2:-2]]
    env = dict(env, HVDTRAIN_WATCHDOG_PORT=str(port))
    # The same job in quiet, nobody at its port, for a fifth of the epochs: its memory is
    # level after the first (a longer run could only hold more, which makes the bound
    # below stricter, not looser).
    quiet_dir = tmp_path / "quiet"
    short = [*args[:args.index("--epochs") + 1], "20", *args[args.index("--epochs") + 2:]]
    proc = start(launch("gloo", 2, "linear", "--run-dir", str(quiet_dir), *short), env)
    peak = PeakMemory(quiet_dir)
    rc, _, err = finish(proc, 240)
    quiet = peak.close()
    assert rc == 0 and quiet > 0, err[-3000:]
    proc = start(launch("gloo", 2, "linear", "--run-dir", str(run_dir), *args), env)
    peak = PeakMemory(run_dir)
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "job did not start"
        pids = wait_for(lambda: rank_pids(str(run_dir)) if len(rank_pids(str(run_dir))) == 2
                        else None, 30)
        before = _rss_mb(pids[0])
        sent = [0]

        def pour():  # 100 MB, no newline, as fast as rank 0 takes it
            chunk = b"x" * (1 << 20)
            try:
                with S.create_connection(("127.0.0.1", port), timeout=20) as s:
                    for _ in range(100):
                        s.sendall(chunk)
                        sent[0] += len(chunk)
            except OSError:
                pass  # rank 0 hung up: what it should do

        pourer = threading.Thread(target=pour)
        pourer.start()
        pourer.join(60)
        assert proc.poll() is None, "the job ended before the attack did: make it longer"
        grown = _rss_mb(pids[0]) - before
        flood = []  # 500 connections that never speak, from 10 threads, closed at once

        def connect(n):
            for _ in range(n):
                try:
                    flood.append(S.create_connection(("127.0.0.1", port), timeout=0.5))
                except OSError:
                    pass  # the backlog is full: dropped by the kernel, not by rank 0

        threads = [threading.Thread(target=connect, args=(50,)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for s in flood:
            s.close()
        assert proc.poll() is None, "the job ended before the flood did: make it longer"
        rc, out, err = finish(proc, 240)
    finally:
        attacked = peak.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc, 30)
    assert rc == 0, err[-3000:]
    assert sent[0] < 100 << 20  # rank 0 closed the endless line ...
    assert grown < 50, f"rank 0 grew by {grown:.0f} MB"  # ... without keeping it
    print(f"rank 0's peak memory: {attacked:.0f} MB attacked, {quiet:.0f} MB in quiet")
    assert attacked - quiet < 50, f"rank 0's peak: {attacked:.0f} MB, in quiet {quiet:.0f} MB"
    assert len(flood) >= 100  # many more than the handshakes rank 0 runs at once (16)
    refusals = [l for l in err.splitlines() if "watchdog: refused" in l]
    assert 1 <= len(refusals) <= 3, refusals
    assert json.load(open(run_dir / "result.json"))["ranks_identical"] is True


FIT_ONE_EPOCH = """
import sys
import numpy as np
import hvdtrain.keras as hk
from hvdtrain.compat import keras
hk.init()
k = keras()
x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)), loss="mse",
              jit_compile=False)
try:
    hk.fit(model, hk.dataset(x, y, batch_size=8), epochs=1, run_dir=sys.argv[1])
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


@pytest.mark.parametrize("path", ["task", "fit"])
def test_a_watchdog_port_in_use_is_one_line_and_nothing_written(path, env, tmp_path):
    import socket as S
    from usercode import env_with, two_ranks, write
    holder = S.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    run_dir = tmp_path / "run"
    try:
        if path == "task":
            p = run(launch("gloo", 2, "linear", "--run-dir", str(run_dir), "--epochs", "1"),
                    dict(env, HVDTRAIN_WATCHDOG_PORT=str(port)))
        else:
            code = write(tmp_path, {"fit_one": FIT_ONE_EPOCH})
            p = run(two_ranks(code / "fit_one.py", run_dir),
                    env_with(code, tmp_path, HVDTRAIN_WATCHDOG_PORT=str(port)))
    finally:
        holder.close()
    lines = [l for l in (p.stdout + p.stderr).splitlines() if "HVDTRAIN_WATCHDOG_PORT" in l]
    assert p.returncode == 1, p.stderr[-3000:]  # horovodrun's status for a failed rank
    assert "exit with status code 2" in p.stdout + p.stderr  # the ranks': a bad setting
    assert len(lines) == 1, lines  # said once, by rank 0
    assert (f"HVDTRAIN_WATCHDOG_PORT={port}: rank 0 cannot listen on 127.0.0.1:{port} "
            "(Address already in use): another process holds it") in lines[0]
    assert not run_dir.exists() or not any(run_dir.iterdir())
