#!/usr/bin/env bash
# Check hvdtrain on this machine's GPUs: both tasks, one process per GPU, through horovodrun.
#
#   scripts/gpu_check.sh                # after HVDTRAIN_GPU=1 scripts/setup.sh
#   CONTROLLER=--gloo scripts/gpu_check.sh
#
# Prints the GPUs (nvidia-smi -L), the stack (python -m hvdtrain.doctor), then for each task
# the figures of its run: world size, final loss, the linear weights and bias, MNIST's test
# accuracy, and samples/s per epoch from metrics.jsonl (the first epoch includes
# compilation). Exit 0: both tasks trained on every GPU. Exit 1: no GPU (nvidia-smi missing or
# listing none), TensorFlow sees fewer GPUs than nvidia-smi, or a run failed.
# Environment: PYTHON (default: the checkout's .venv), OUT (default: runs/gpu-check-TIME),
# CONTROLLER (--mpi or --gloo; default: Horovod's choice), MNIST_EPOCHS (default 3).
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

# --- both tasks, one process per GPU --------------------------------------------------
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PYTHONUNBUFFERED=1
horovodrun=$(dirname "$python")/horovodrun
status=0
for task in linear mnist; do
    args=(--run-dir "$out/$task")
    if [[ $task == mnist ]]; then args+=(--epochs "${MNIST_EPOCHS:-3}"); fi
    echo "== $task: horovodrun -np $gpus ${CONTROLLER:-} python -m hvdtrain.$task ${args[*]}"
    start=$SECONDS
    # shellcheck disable=SC2086  # CONTROLLER is zero or one word
    if ! "$horovodrun" -np "$gpus" ${CONTROLLER:-} "$python" -m "hvdtrain.$task" "${args[@]}"; then
        echo "gpu_check.sh: $task failed" >&2; status=1; continue
    fi
    echo "== $task took $((SECONDS - start)) s"
done

# --- the figures ----------------------------------------------------------------------
"$python" - "$out" "$gpus" <<'PY' || status=1
import json, os, sys
out, gpus = sys.argv[1], int(sys.argv[2])
ok = True
for task in ("linear", "mnist"):
    path = os.path.join(out, task, "result.json")
    if not os.path.exists(path):
        print(f"{task}: no result.json"); ok = False; continue
    r = json.load(open(path))
    epochs = [json.loads(l) for l in open(os.path.join(out, task, "metrics.jsonl"))]
    rates = [e["samples_per_sec"] for e in epochs]
    print(f"{task}: world size {r['world_size']} ({r['backend']}), {r['global_step']} steps, "
          f"final loss {r['final_loss']:.6g}, {sum(e['seconds'] for e in epochs):.1f} s training")
    if task == "linear":
        print(f"  weights {[round(w, 6) for w in r['weights']]}  bias {r['bias']:.6f}")
    else:
        print(f"  test accuracy {r['test_accuracy']:.4f} on {r['test_examples']} "
              f"{r['dataset']} examples")
    print("  samples/s by epoch " + ", ".join(f"{s:,.0f}" for s in rates))
    ok &= r["world_size"] == gpus
print(f"{'OK' if ok else 'FAILED'}: {gpus} GPU(s), results in {out}")
sys.exit(0 if ok else 1)
PY
exit "$status"
