#!/usr/bin/env bash
# Horovod's own tests and TF2 examples (a checkout of github.com/horovod/horovod at v0.28.1)
# on the venv scripts/setup.sh made, under Keras 3 and Keras 2, as Horovod's CI runs them.
#
#   scripts/horovod_upstream.sh HOROVOD_SRC     # e.g. git clone -b v0.28.1 .../horovod
#
# Not part of scripts/test.sh: Horovod's tests are not in its sdist, and CI has no network to
# fetch them (tests/test_horovod_api.py checks the same APIs in the project's own code).
# Prints each file's pytest summary and failed tests per Keras, then runs
# examples/tensorflow2/tensorflow2_mnist.py and tensorflow2_keras_mnist.py with horovodrun
# -np 2, changed only in: the digits come from hvdtrain.datasets.mnist() instead of a download,
# the step counts are cut; and under Keras 3 the Keras 2-only code the README's "Your Horovod
# scripts" lists is left out (`experimental_run_tf_function=False`, `opt.variables()`).
# Needs pytest's `parameterized` and `mock` (pip install parameterized mock; Horovod's tests
# import them). About 10 minutes on 2 cores.
set -uo pipefail
src=${1:?usage: scripts/horovod_upstream.sh HOROVOD_SRC}
src=$(cd "$src" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$root/.venv}
export PATH=$venv/bin:$PATH TF_CPP_MIN_LOG_LEVEL=3 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
python - "$work/mnist.npz" <<'PY'
import sys
import numpy as np
from hvdtrain.datasets import mnist
(x, y), _ = mnist()  # Keras' cached MNIST, else the bundled sample: no download
np.savez(sys.argv[1], x=x, y=y)
PY
for keras in 3 2; do
    if [[ $keras == 2 ]]; then export TF_USE_LEGACY_KERAS=1; else unset TF_USE_LEGACY_KERAS; fi
    for f in test_tensorflow.py test_tensorflow2_keras.py; do
        log="$work/keras$keras-$f.log"
        (cd "$src/test/parallel" && timeout 1800 horovodrun -np 2 -H localhost:2 --gloo \
            python -m pytest -q -p no:cacheprovider -rf "$f") >"$log" 2>&1
        echo "Keras $keras $f: $(grep -oE '^\[0\]<stdout>:[0-9]+ (passed|failed).*' "$log" | tail -1 | cut -d: -f2-)"
        grep -oE '^\[0\]<stdout>:FAILED [^ ]+' "$log" | sed 's/^\[0\]<stdout>:/    /' | sort -u
    done
    for ex in tensorflow2_mnist.py tensorflow2_keras_mnist.py; do
        copy="$work/keras$keras-$ex"
        sed -e "s|tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())|((lambda d: (d['x'], d['y']))(__import__('numpy').load('$work/mnist.npz')), None)|" \
            -e 's|dataset.take(10000 // hvd.size())|dataset.take(40 // hvd.size())|' \
            -e 's|steps_per_epoch=500 // hvd.size(), callbacks=callbacks, epochs=24|steps_per_epoch=16 // hvd.size(), callbacks=callbacks, epochs=4|' \
            "$src/examples/tensorflow2/$ex" >"$copy"
        if [[ $keras == 3 ]]; then
            sed -i -e 's|^\(\s*\)experimental_run_tf_function=False)|\1)|' -e 's|opt.variables()|opt.variables|' "$copy"
        fi
        echo "Keras $keras $ex, changed lines:"
        diff "$src/examples/tensorflow2/$ex" "$copy" | grep '^>' | sed 's/^/    /'
        if (cd "$work" && timeout 600 horovodrun -np 2 -H localhost:2 --gloo python "$copy") >"$copy.log" 2>&1; then
            echo "    ran to the end: $(grep -cE 'Step #|Epoch [0-9]+/' "$copy.log") progress lines"
        else
            echo "    FAILED:"; grep -v "I0000\|WARNING" "$copy.log" | tail -5 | sed 's/^/    /'; status=1
        fi
    done
done
exit $status
