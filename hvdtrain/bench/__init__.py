"""hvdtrain's benchmark suite: ``python -m hvdtrain.bench [--quick] [--cases ...] [--out DIR]``.

Every comparison runs side by side in one invocation (the machine's load changes between
invocations, a ratio measured in one run does not), and the suite writes ``results.json``,
``results.md`` (tables and the acceptance ratios) and PNG plots into ``--out``.

Modules: ``workers`` and ``fit_workers`` (the entry points each benchmark process runs),
``cases`` (the launches of Horovod's and TensorFlow's comparisons: allreduce, throughput,
steps per call, time to accuracy, timeline), ``fit_cases`` (those of the Keras fit paths:
fit, keras_speed, pipeline), ``model_cases`` and ``model_workers`` (the models users train:
a ResNet-50, a transformer encoder, a wide MLP through every path), ``projection`` (``python -m
hvdtrain.bench project``: a cost model of the reduction on GPU clusters, launching nothing),
``report`` (tables, ratios, plots), ``harness`` (the process harness: each process in its
own session, bounded in time; hvdtrain's tests launch with it too).

A developer's tool, not part of training: nothing else in hvdtrain imports this package. It
is the optional part ``hvdtrain[bench]``: the tables and ratios need hvdtrain alone, the PNG
plots need that extra's matplotlib (``pip install hvdtrain[bench]``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from hvdtrain.bench import harness

# The process harness is the tests' too: the same environment and launch commands.
python, horovodrun, mpirun = harness.python, harness.horovodrun, harness.mpirun


class BenchError(RuntimeError):
    """A benchmark process failed or timed out; ``str()`` names the command and its stderr."""


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes per second (nccl-tests: size / time)."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, nranks: int) -> float:
    """Bus bandwidth of an allreduce (nccl-tests): algbw * 2(n-1)/n, comparable across n."""
    return algbw(nbytes, seconds) * 2 * (nranks - 1) / nranks


def env(**extra) -> dict:
    """The environment of every benchmark process (``harness.environment``)."""
    return harness.environment(**extra)


def keras_env(keras2: bool) -> dict:
    """``env()`` for a process on Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1) or Keras 3."""
    environ = env(**({"TF_USE_LEGACY_KERAS": "1"} if keras2 else {}))
    if not keras2:
        environ.pop("TF_USE_LEGACY_KERAS", None)
    return environ


def write_json(path: str, obj) -> None:
    """A benchmark process's result, one JSON object."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def run(cmd: list, environ: dict = None, timeout: float = 600) -> float:
    """Run ``cmd`` in its own session; kill the whole group after ``timeout`` s.

    Returns the wall seconds; raises BenchError on failure or time-out."""
    tick = time.perf_counter()
    try:
        proc = harness.run(cmd, environ or env(), timeout)
    except harness.Timeout as e:
        raise BenchError(str(e)) from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise BenchError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - tick


def free_ports(n: int) -> list:
    """``n`` loopback ports free right now (for TF_CONFIG)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


CORE_SPEED = """
import json, time
import numpy as np
def best(fn, n=5):
    times = []
    for _ in range(n):
        tick = time.perf_counter(); fn(); times.append(time.perf_counter() - tick)
    return min(times)
a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
src = np.ones(16 << 18, np.float32); dst = np.empty_like(src)
def loop():
    total = 0
    for i in range(1_000_000):
        total += i
print(json.dumps({"matmul_gflops": 2 * 1024 ** 3 / best(lambda: a @ a) / 1e9,
                  "python_mops": 1.0 / best(loop),
                  "copy_gbps": src.nbytes / best(lambda: np.copyto(dst, src)) / 1e9}))
"""


def core_speed() -> dict:
    """One core's speed on fixed work (a 1024^2 float32 matmul with one BLAS thread, a Python
    loop, a 64 MiB copy), best of 5: printed beside the tables so that runs on different
    machines can be compared; ratios inside one run never need it."""
    import json

    one = dict(env(), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", CORE_SPEED], env=one, capture_output=True, text=True, timeout=120
    )
    if out.returncode:
        raise BenchError(f"core speed probe failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)
