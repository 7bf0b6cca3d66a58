"""hvdtrain's benchmark suite: ``python -m hvdtrain.bench [--quick] [--cases ...] [--out DIR]``.

Every comparison runs side by side in one invocation (the machine's load changes between
invocations, a ratio measured in one run does not), and the suite writes ``results.json``,
``results.md`` (tables and the acceptance ratios) and PNG plots into ``--out``.

Modules: ``workers`` (the entry points each benchmark process runs), ``cases`` (the launches:
allreduce, throughput, time to accuracy, timeline), ``report`` (tables, ratios, plots).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")


class BenchError(RuntimeError):
    """A benchmark process failed or timed out; ``str()`` names the command and its stderr."""


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes per second (nccl-tests: size / time)."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, nranks: int) -> float:
    """Bus bandwidth of an allreduce (nccl-tests): algbw * 2(n-1)/n, comparable across n."""
    return algbw(nbytes, seconds) * 2 * (nranks - 1) / nranks


def env(**extra) -> dict:
    """The environment of every benchmark process: quiet TensorFlow, root allowed for MPI."""
    e = dict(os.environ)
    e.update(PYTHONPATH=ROOT + os.pathsep + e.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3",
             PATH=BIN + os.pathsep + e.get("PATH", ""), PYTHONUNBUFFERED="1",
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "TF_CONFIG"):
        e.pop(name, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def python(module: str, *args) -> list:
    return [sys.executable, "-m", module, *map(str, args)]


def horovodrun(np: int, controller: str, cmd: list) -> list:
    """``horovodrun -np N --mpi|--gloo cmd``: hvdtrain's documented launcher."""
    return [HOROVODRUN, "-np", str(np), f"--{controller}", *cmd]


def mpirun(np: int, cmd: list) -> list:
    return ["mpirun", "-np", str(np), "--allow-run-as-root", "--oversubscribe",
            "--bind-to", "none", *cmd]


def run(cmd: list, environ: dict = None, timeout: float = 600) -> float:
    """Run ``cmd`` in its own session; kill the whole group after ``timeout`` s.

    Returns the wall seconds; raises BenchError on failure or time-out."""
    tick = time.perf_counter()
    proc = subprocess.Popen(cmd, env=environ or env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        tail = "\n".join((out + err).strip().splitlines()[-15:])
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
    out = subprocess.run([sys.executable, "-c", CORE_SPEED], env=one, capture_output=True,
                         text=True, timeout=120)
    if out.returncode:
        raise BenchError(f"core speed probe failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)
