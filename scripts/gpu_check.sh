#!/usr/bin/env bash
# Check hvdtrain on this machine's GPUs, one process per GPU, and print a table.
#
#   scripts/gpu_check.sh                # after HVDTRAIN_GPU=1 scripts/setup.sh
#   CONTROLLER=--gloo scripts/gpu_check.sh
#
# 1. kernels: each GPU's compute capability (nvidia-smi) against the architectures Horovod's
#    kernels were compiled for (the doctor reads them from the library): a cubin of the same
#    major and a lower or equal minor, or PTX of a lower or equal one (JIT by the driver); and
#    the driver's CUDA version against the kernels' compiler (nvcc 13.0 for setup.sh's build).
# 2. nccl: an allreduce of 1 MiB and 64 MiB float32 tensors held on the GPUs, through
#    horovodrun: the sums are checked, and Horovod's timeline must show NCCL_ALLREDUCE.
# 3. linear and mnist: both tasks through horovodrun on every GPU; world size, weights, test
#    accuracy, samples/s.
# 4. models: the models bench's ResNet-50 (python -m hvdtrain.bench --cases models) through
#    hvdtrain's Task path on every GPU against one process on one GPU: samples/s, scaling
#    efficiency, gradient bytes.
# Exit 0: every check passed. Exit 1: no GPU (nvidia-smi missing or listing none), TensorFlow
# sees fewer GPUs than nvidia-smi, or a check failed.
# Environment: PYTHON (default: the checkout's .venv), OUT (default: runs/gpu-check-TIME),
# CONTROLLER (--mpi or --gloo; default: Horovod's choice), MNIST_EPOCHS (default 3),
# MODEL_BATCH (the ResNet-50's images per GPU, 32x32; default 256: a step of tens of ms).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-$root/runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
fail() { echo "gpu_check.sh: error: $*" >&2; exit 1; }

# --- GPUs ---------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || fail "no GPU: nvidia-smi not found (no NVIDIA driver on this machine)"
listing=$(nvidia-smi -L 2>&1) || fail "no GPU: nvidia-smi -L failed: $listing"
gpus=$(grep -c '^GPU [0-9]' <<<"$listing" || true)
((gpus >= 1)) || fail "no GPU: nvidia-smi -L lists none"
echo "$listing"
"$python" -m hvdtrain.doctor || echo "gpu_check.sh: the doctor found problems (above); continuing"
visible=$("$python" -c 'import hvdtrain, tensorflow as tf; print(len(tf.config.list_physical_devices("GPU")))' 2>/dev/null) ||
    fail "TensorFlow does not import with $python"
((visible >= gpus)) ||
    fail "nvidia-smi lists $gpus GPU(s) but TensorFlow sees $visible: HVDTRAIN_GPU=1 scripts/setup.sh installs CUDA TensorFlow"
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv,noheader >"$out/gpus.csv" ||
    fail "nvidia-smi --query-gpu failed"
nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1 >"$out/driver_cuda.txt" || true
"$python" -m hvdtrain.doctor --json >"$out/doctor.json" || true

# --- the checks, one process per GPU ----------------------------------------------------
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PYTHONUNBUFFERED=1
horovodrun=$(dirname "$python")/horovodrun
status=0
launch() {  # NAME ARGS...: horovodrun -np GPUS ARGS, output to OUT/NAME.log
    local name=$1; shift
    echo "== $name: horovodrun -np $gpus ${CONTROLLER:-} $*"
    local start=$SECONDS
    # shellcheck disable=SC2086  # CONTROLLER is zero or one word
    if ! "$horovodrun" -np "$gpus" ${CONTROLLER:-} "$@" >"$out/$name.log" 2>&1; then
        tail -20 "$out/$name.log" >&2; echo "gpu_check.sh: $name failed (log: $out/$name.log)" >&2
        status=1
    fi
    echo "$((SECONDS - start))" >"$out/$name.seconds"
}
cat >"$out/nccl_allreduce.py" <<'PY'
"""Allreduce float32 tensors held on each rank's GPU; rank 0 writes the figures."""
import json, sys, time
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
gpus = tf.config.list_physical_devices("GPU")
tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
rows = []
for mib in (1, 64):
    n = mib * 2**20 // 4
    with tf.device("/GPU:0"):
        x = tf.fill([n], float(hvd.rank() + 1))
        assert "GPU" in x.device, x.device
        y = hvd.allreduce(x, op=hvd.Sum, name=f"check{mib}")  # warm-up, and the value
        want = hvd.size() * (hvd.size() + 1) / 2
        ok = bool(tf.reduce_all(tf.equal(y, want)))
        start = time.perf_counter()
        for i in range(10):
            y = hvd.allreduce(x, op=hvd.Sum, name=f"time{mib}_{i}")
        _ = y.numpy()
        seconds = (time.perf_counter() - start) / 10
    # bus bandwidth as nccl-tests counts it: 2 (n-1)/n of the bytes per allreduce
    bus = 2 * (hvd.size() - 1) / hvd.size() * n * 4 / seconds / 1e9
    rows.append({"MiB": mib, "sum_ok": ok, "ms": seconds * 1e3, "bus_GBps": bus, "device": y.device})
if hvd.rank() == 0:
    json.dump(rows, open(sys.argv[1], "w"))
PY
HOROVOD_TIMELINE=$out/timeline.json launch nccl "$python" "$out/nccl_allreduce.py" "$out/nccl.json"
for task in linear mnist; do
    args=(--run-dir "$out/$task")
    if [[ $task == mnist ]]; then args+=(--epochs "${MNIST_EPOCHS:-3}"); fi
    launch "$task" "$python" -m "hvdtrain.$task" "${args[@]}"
done
# The models bench's ResNet-50: one process on one GPU (the reference), then the Task path on
# every GPU, at the same batch per GPU; 20 steps an epoch, the first of 3 epochs traces.
model=(--model resnet --batch "${MODEL_BATCH:-256}" --steps 20 --epochs 3)
echo "== models: one process, one GPU"
CUDA_VISIBLE_DEVICES=0 "$python" -m hvdtrain.bench.model_workers one --threads 4 \
    --out "$out/models-one.json" "${model[@]}" >"$out/models-one.log" 2>&1 ||
    { tail -20 "$out/models-one.log" >&2; status=1; }
launch models-task "$python" -m hvdtrain.bench.model_workers task \
    --out "$out/models-task.json" "${model[@]}"

# --- the table ------------------------------------------------------------------------
"$python" - "$out" "$gpus" <<'PY' || status=1
import csv, json, os, re, sys
out, gpus = sys.argv[1], int(sys.argv[2])
rows, ok = [], True

def row(check, passed, figures):
    global ok
    ok &= passed
    rows.append((check, "ok" if passed else "FAILED", figures))

def read(name):
    path = os.path.join(out, name)
    return open(path).read() if os.path.exists(path) else ""

doctor = json.loads(read("doctor.json") or "{}")
build = (doctor.get("horovod") or {}).get("gpu_build") or {}
cubins = [int(a[3:]) for a in build.get("cubin", [])]
ptx = [int(re.sub(r"\D", "", a)) for a in build.get("ptx", [])]
compiler = re.search(r"release ([0-9]+)\.([0-9]+)", build.get("compiler") or "")
m = re.search(r"([0-9]+)\.([0-9]+)", read("driver_cuda.txt"))
driver = (int(m[1]), int(m[2])) if m else None
for index, name, cap, version in csv.reader(read("gpus.csv").splitlines(), skipinitialspace=True):
    major, minor = (int(v) for v in cap.split("."))
    cc = major * 10 + minor
    sass = [c for c in cubins if c // 10 == major and c % 10 <= minor]
    jit = [c for c in ptx if c <= cc]
    how = f"cubin sm_{max(sass)}" if sass else f"PTX compute_{max(jit)} (JIT)" if jit else "none"
    row(f"kernels GPU {index}", bool(sass or jit), f"{name}, compute {cap}, {how}")
if compiler and driver:
    need = (int(compiler[1]), int(compiler[2]))
    # Not a failure by itself: the allreduce below shows whether the driver loads them.
    rows.append(("driver", "ok" if driver >= need else "older",
                 f"driver CUDA {driver[0]}.{driver[1]}, kernels by nvcc {need[0]}.{need[1]}"))
else:
    row("driver", False, f"unknown: driver {read('driver_cuda.txt').strip() or '?'}, "
        f"compiler {build.get('compiler') or '? (not a GPU build of setup.sh)'}")
nccl = json.loads(read("nccl.json") or "[]")
timeline = read("timeline.json")
used = "NCCL_ALLREDUCE" in timeline
for r in nccl:
    row(f"nccl {r['MiB']} MiB", r["sum_ok"] and used and "GPU" in r["device"],
        f"{r['ms']:.2f} ms, bus {r['bus_GBps']:.1f} GB/s, "
        f"{'NCCL_ALLREDUCE in timeline' if used else 'no NCCL_ALLREDUCE in timeline'}")
if not nccl:
    row("nccl", False, f"no result (log: {os.path.join(out, 'nccl.log')})")
for task in ("linear", "mnist"):
    path = os.path.join(out, task, "result.json")
    if not os.path.exists(path):
        row(task, False, f"no result.json (log: {os.path.join(out, task + '.log')})")
        continue
    r = json.load(open(path))
    rates = [json.loads(l)["samples_per_sec"] for l in open(os.path.join(out, task, "metrics.jsonl"))]
    if task == "linear":
        passed = all(abs(w - t) < 1e-3 for w, t in zip(r["weights"], (0.1, 0.2, 0.3)))
        what = f"weights {[round(w, 4) for w in r['weights']]} bias {r['bias']:.4f}"
    else:
        passed = r["test_accuracy"] > 0.5
        what = f"test accuracy {r['test_accuracy']:.4f} ({r['dataset']})"
    row(task, passed and r["world_size"] == gpus and r["ranks_identical"],
        f"{r['world_size']} ranks, {what}, last epoch {rates[-1]:,.0f} samples/s, "
        f"{read(task + '.seconds').strip()} s")
def steady(path):  # samples/s over the epochs after the first (which traces)
    epochs = json.load(open(path))["epochs"][1:]
    return sum(e["samples_per_sec"] * e["seconds"] for e in epochs) / sum(e["seconds"] for e in epochs)

one, task = (os.path.join(out, f"models-{v}.json") for v in ("one", "task"))
if os.path.exists(one) and os.path.exists(task):
    r = json.load(open(task))
    alone, together = steady(one), steady(task)
    efficiency = together / (r["ranks"] * alone)
    row("models resnet", r["ranks"] == gpus and 0 < efficiency,
        f"{r['ranks']} ranks, {together:,.0f} samples/s against {alone:,.0f} on one GPU: "
        f"scaling efficiency {efficiency:.2f}, {r['gradient_bytes'] / 1e6:.0f} MB of gradients "
        f"a step, batch {r['batch_per_rank']} per GPU")
else:
    row("models resnet", False, f"no result (logs: {out}/models-one.log, models-task.log)")
width = max(len(c) for c, _, _ in rows)
print(f"\n{'check':<{width}}  result  figures")
for check, result, figures in rows:
    print(f"{check:<{width}}  {result:<6}  {figures}")
print(f"{'OK' if ok else 'FAILED'}: {gpus} GPU(s), results in {out}")
sys.exit(0 if ok else 1)
PY
exit "$status"
