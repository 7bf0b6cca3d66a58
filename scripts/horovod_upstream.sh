#!/usr/bin/env bash
# Horovod's own tests and TF2 examples (a checkout of github.com/horovod/horovod at v0.28.1)
# on the venv scripts/setup.sh made, under Keras 3 and Keras 2, as Horovod's CI runs them.
#
#   scripts/horovod_upstream.sh HOROVOD_SRC [FILE...]   # e.g. git clone -b v0.28.1 .../horovod
#
# FILE: only these (a test file's name, or an example's); HVDTRAIN_UPSTREAM_KERAS="3 2": the
# Keras passes to run.
#
# Not part of scripts/test.sh: Horovod's tests are not in its sdist, and CI has no network to
# fetch them (tests/runs/test_horovod_api.py checks the same APIs in the project's own code).
# Prints each file's pytest summary and failed tests per Keras: the parallel files under
# `horovodrun -np 2 -H localhost:2 --gloo pytest` (Adasum's under the MPI controller, which it
# needs), the elastic integration files with plain pytest one file at a time (pytest-forked,
# Horovod CI's --forked, exits 3 under pytest 9), in a copy whose training scripts drop the
# Keras file's TF1 session lines (tf.ConfigProto, tf.Session) and, under Keras 3, read
# `optimizer.learning_rate` for the tests' `optimizer.lr` (and assign it where the Keras file
# sets it with tf.keras.backend.set_value). Then it runs
# examples/tensorflow2/tensorflow2_mnist.py and tensorflow2_keras_mnist.py with horovodrun
# -np 2, changed only in: the digits come from hvdtrain.datasets.mnist() instead of a download,
# the step counts are cut; and under Keras 3 the Keras 2-only code that
# docs/guides/horovod-scripts.md lists is left out (`experimental_run_tf_function=False`,
# `opt.variables()`). With the "ray" extra installed, Horovod's Ray tests (test/single/test_ray.py,
# test_ray_elastic.py) too, on TensorFlow where they use PyTorch, and its Ray example
# (examples/ray/tensorflow2_mnist_ray.py) as a Ray driver (below). With the "spark" extra and
# Java, Horovod's Spark tests (test/integration/test_spark.py, test_spark_keras.py,
# test_elastic_spark_tensorflow2.py: horovod.spark.run and run_elastic on a local and a
# standalone Spark, the KerasEstimator), on TensorFlow where they use PyTorch (below): about 5
# minutes for test_spark.py, 3 for test_spark_keras.py, 30 for the elastic one.
# Needs pytest's `parameterized` and `mock` (pip install parameterized mock; Horovod's tests
# import them). About 10 minutes on 2 cores, and as much again for the elastic files.
set -uo pipefail
src=${1:?usage: scripts/horovod_upstream.sh HOROVOD_SRC [FILE...]}
src=$(cd "$src" && pwd)
shift
only=" $* "
wanted() { [[ "$only" == "  " || "$only" == *" $1 "* ]]; }
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
# The examples' MNIST: the digits above instead of a download.
digits="s|tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())|((lambda d: (d['x'], d['y']))(__import__('numpy').load('$work/mnist.npz')), None)|"
# Keras 3: compile() without Keras 2's experimental_run_tf_function=False.
no_tf_function='s|^\(\s*\)experimental_run_tf_function=False)|\1)|'
for keras in ${HVDTRAIN_UPSTREAM_KERAS:-3 2}; do
    if [[ $keras == 2 ]]; then export TF_USE_LEGACY_KERAS=1; else unset TF_USE_LEGACY_KERAS; fi
    for f in test_tensorflow.py test_tensorflow2_keras.py test_tensorflow_process_sets.py \
             test_tensorflow2_keras_process_sets.py test_tensorflow_process_sets_dynamic.py \
             test_adasum_tensorflow.py; do
        wanted "$f" || continue
        log="$work/keras$keras-$f.log"
        controller=--gloo
        [[ $f == test_adasum_* ]] && controller=--mpi  # Adasum is MPI's only
        (cd "$src/test/parallel" && timeout 1800 horovodrun -np 2 -H localhost:2 $controller \
            python -m pytest -q -p no:cacheprovider --color=no -rf "$f") >"$log" 2>&1
        echo "Keras $keras $f: $(grep -oE '^\[(0|1,0)\]<stdout>:[0-9]+ (passed|failed|skipped).*' "$log" | tail -1 | cut -d: -f2-)"
        grep -oE '^\[(0|1,0)\]<stdout>:FAILED [^ ]+' "$log" | sed -E 's/^\[(0|1,0)\]<stdout>:/    /' | sort -u
    done
    # The elastic integration files: a copy of test/ (and setup.cfg, its pytest settings)
    # with the training scripts changed.
    copy="$work/keras$keras-src"
    if wanted test_elastic_tensorflow2.py || wanted test_elastic_tensorflow_keras.py \
            || wanted test_spark.py || wanted test_spark_keras.py \
            || wanted test_elastic_spark_tensorflow2.py; then
        rm -rf "$copy" && mkdir "$copy" && cp -r "$src/test" "$src/setup.cfg" "$copy/"
        sed -i -e '/^config = tf.ConfigProto()/d' -e '/^config.gpu_options\./d' \
            -e '/tf.keras.backend.set_session(tf.Session/d' \
            "$copy/test/integration/data/elastic_tensorflow_keras_main.py"
        if [[ $keras == 3 ]]; then
            # (Keras 3's tf.keras.backend.set_value takes TF variables only: assign instead)
            sed -i -e 's/tf\.keras\.backend\.set_value(model\.optimizer\.lr, \(.*\))$/model.optimizer.learning_rate.assign(\1)/' \
                -e 's/optimizer\.lr\b/optimizer.learning_rate/' \
                "$copy"/test/integration/data/elastic_tensorflow{2,_keras}_main.py
        fi
        echo "Keras $keras elastic training scripts, changed lines:"
        for d in elastic_tensorflow2_main.py elastic_tensorflow_keras_main.py; do
            diff "$src/test/integration/data/$d" "$copy/test/integration/data/$d" | grep '^[<>]' \
                | sed "s/^/    $d /"
        done
    fi
    for f in test_elastic_tensorflow2.py test_elastic_tensorflow_keras.py; do
        wanted "$f" || continue
        log="$work/keras$keras-$f.log"
        (cd "$copy/test/integration" && timeout 1800 python -m pytest -q -p no:cacheprovider --color=no -rf "$f") >"$log" 2>&1
        echo "Keras $keras $f: $(grep -E '^=* ?[0-9]+ (passed|failed|skipped).* in ' "$log" | tail -1 | tr -d '=')"
        grep -oE '^FAILED [^ ]+' "$log" | sed 's/^/    /' | sort -u
    done
    # Horovod's Spark tests (the "spark" extra, and Java): plain pytest one file at a time in the
    # copy above, as Horovod's CI runs them (SPARK_HOME pyspark's, here a folder of links to it so
    # that the standalone cluster's logs and work folders stay out of the venv). test_spark.py's
    # tests that start Horovod with PyTorch do it with horovod.tensorflow (an allgather of the
    # ranks), and the ranks' stderr the tests compare is without TensorFlow's startup lines
    # (which TF_CPP_MIN_LOG_LEVEL does not silence: they come before its logging starts).
    for f in test_spark.py test_spark_keras.py test_elastic_spark_tensorflow2.py; do
        wanted "$f" || continue
        if ! python -c 'import pyspark' 2>/dev/null || ! command -v java >/dev/null; then
            echo "Keras $keras $f: not run (no pyspark or no java: pip install -c constraints.txt '.[spark]')"; continue
        fi
        if [[ $f == test_spark.py ]]; then
            python - "$copy/test/integration/$f" <<'PY'
import sys
path = sys.argv[1]
s = open(path).read()
s = s.replace("import horovod.torch as hvd", "import horovod.tensorflow as hvd")
s = s.replace("            import torch\n", "            import tensorflow as tf\n")
s = s.replace("hvd.allgather(torch.tensor([hvd.rank()])).tolist()",
              "hvd.allgather(tf.constant([hvd.rank()])).numpy().tolist()")
s = s.replace("self.assertRegex(stderr.getvalue(),",
              "self.assertRegex(re.sub(r'\\[[01]\\]<stderr>:(WARNING: All log messages before absl"
              "|I0000 ).*\\n', '', stderr.getvalue()),")
open(path, "w").write(s)
PY
            echo "Keras $keras $f, changed lines:"
            diff "$src/test/integration/$f" "$copy/test/integration/$f" | grep '^>' | sed "s/^/    $f /"
        fi
        spark_home="$work/spark-home"
        if [[ ! -d $spark_home ]]; then
            mkdir -p "$spark_home/pids"
            for l in "$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"/*; do
                [[ ${l##*/} == logs || ${l##*/} == work ]] || ln -s "$l" "$spark_home/"
            done
        fi
        log="$work/keras$keras-$f.log"
        (cd "$copy/test/integration" && SPARK_HOME=$spark_home SPARK_PID_DIR=$spark_home/pids \
            SPARK_DRIVER_MEM=512m PYSPARK_PYTHON=$venv/bin/python PYSPARK_DRIVER_PYTHON=$venv/bin/python \
            timeout 3600 python -m pytest -q -p no:cacheprovider --color=no -rfE "$f") >"$log" 2>&1
        echo "Keras $keras $f: $(grep -E '^=* ?[0-9]+ (passed|failed|skipped|error).* in ' "$log" | tail -1 | tr -d '=')"
        grep -oE '^(FAILED|ERROR) [^ ]+' "$log" | sed 's/^/    /' | sort -u
    done
    # Horovod's Ray tests (the "ray" extra), plain pytest one file at a time, in a copy: this
    # stack has no PyTorch, so `torch` is a stand-in that says no CUDA (the GPU tests skip),
    # the tests that only start Horovod on the Ray workers (hvd.init, hvd.rank) do it with
    # horovod.tensorflow, and the elastic tests' training function trains a Keras model with
    # hvd.elastic.KerasState; the tests that train a PyTorch model (test_ray.py's _train) are
    # deselected. Ray 1.x's ray.init(_redis_max_memory=...), which Ray 2 refuses, is left
    # out; `mock` is unittest's.
    for f in test_ray.py test_ray_elastic.py; do
        wanted "$f" || continue
        if ! python -c 'import ray' 2>/dev/null; then
            echo "Keras $keras $f: not run (no ray: pip install -c constraints.txt '.[ray]')"; continue
        fi
        copy="$work/keras$keras-ray"
        mkdir -p "$copy" && cp "$src/test/single/$f" "$copy/$f"
        python - "$copy/$f" <<'PY'
import re, sys
path = sys.argv[1]
s = open(path).read()
s = re.sub(r"^import torch$", "class torch:  # no PyTorch here\n    class cuda:\n"
           "        is_available = staticmethod(lambda: False)\n"
           "        device_count = staticmethod(lambda: 0)", s, flags=re.M)
s = s.replace("import mock\n", "from unittest import mock\n")
s = s.replace(", _redis_max_memory=1024 * 1024 * 1024", "")
if path.endswith("test_ray_elastic.py"):
    s = s.replace("        import torch\n        import horovod.torch as hvd\n",
                  "        import tensorflow as tf\n        import horovod.tensorflow.keras as hvd\n")
    s = s.replace("model = torch.nn.Sequential(torch.nn.Linear(2, 2))",
                  "model = tf.keras.Sequential([tf.keras.Input(shape=(2,)), tf.keras.layers.Dense(2)])")
    s = s.replace("optimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
                  "optimizer = tf.keras.optimizers.SGD(0.1)")
    s = s.replace("hvd.elastic.TorchState(", "hvd.elastic.KerasState(")
else:
    s = s.replace("import horovod.torch as hvd", "import horovod.tensorflow as hvd")
open(path, "w").write(s)
PY
        echo "Keras $keras $f, changed lines:"
        diff "$src/test/single/$f" "$copy/$f" | grep '^[<>]' | sed "s/^/    $f /"
        deselect=()
        [[ $f == test_ray.py ]] && deselect=(-k "not horovod_train and not remote_client_train")
        log="$work/keras$keras-$f.log"
        (cd "$copy" && RAY_USAGE_STATS_ENABLED=0 timeout 1800 python -m pytest -q -p no:cacheprovider \
            --color=no -rfE -o addopts= "${deselect[@]}" "$f") >"$log" 2>&1
        echo "Keras $keras $f: $(grep -E '^=* ?[0-9]+ (passed|failed|skipped|deselected|error).* in ' "$log" | tail -1 | tr -d '=')"
        grep -oE '^(FAILED|ERROR) [^ ]+' "$log" | sed 's/^/    /' | sort -u
    done
    for ex in tensorflow2_mnist.py tensorflow2_keras_mnist.py; do
        wanted "$ex" || continue
        copy="$work/keras$keras-$ex"
        sed -e "$digits" \
            -e 's|dataset.take(10000 // hvd.size())|dataset.take(40 // hvd.size())|' \
            -e 's|steps_per_epoch=500 // hvd.size(), callbacks=callbacks, epochs=24|steps_per_epoch=16 // hvd.size(), callbacks=callbacks, epochs=4|' \
            "$src/examples/tensorflow2/$ex" >"$copy"
        if [[ $keras == 3 ]]; then
            sed -i -e "$no_tf_function" -e 's|opt.variables()|opt.variables|' "$copy"
        fi
        echo "Keras $keras $ex, changed lines:"
        diff "$src/examples/tensorflow2/$ex" "$copy" | grep '^>' | sed 's/^/    /'
        if (cd "$work" && timeout 600 horovodrun -np 2 -H localhost:2 --gloo python "$copy") >"$copy.log" 2>&1; then
            echo "    ran to the end: $(grep -cE 'Step #|Epoch [0-9]+/' "$copy.log") progress lines"
        else
            echo "    FAILED:"; grep -v "I0000\|WARNING" "$copy.log" | tail -5 | sed 's/^/    /'; status=1
        fi
    done
    # Horovod's Ray example: run as a Ray driver (it starts a Ray of its own here), changed as
    # the examples above are, and in its executor: it passes RayExecutor arguments of an older
    # horovod.ray (num_slots=, cpus_per_slot=), which 0.28.1's refuses (a TypeError as
    # released), and asks for 2 hosts of 4 workers of 8 CPUs: 2 workers of 1 CPU here.
    ex=tensorflow2_mnist_ray.py
    if wanted "$ex"; then
        if ! python -c 'import ray' 2>/dev/null; then
            echo "Keras $keras $ex: not run (no ray: pip install -c constraints.txt '.[ray]')"
        else
            copy="$work/keras$keras-$ex"
            sed -e "$digits" \
                -e 's|steps_per_epoch=500 // hvd.size(),|steps_per_epoch=16 // hvd.size(),|' \
                -e 's|settings, num_hosts=2, num_slots=4, use_gpu=False, cpus_per_slot=8)|settings, num_workers=2, use_gpu=False, cpus_per_worker=1)|' \
                "$src/examples/ray/$ex" >"$copy"
            if [[ $keras == 3 ]]; then
                sed -i -e "$no_tf_function" \
                    -e "s|'./checkpoint-{epoch}.h5'|'./checkpoint-{epoch}.keras'|" "$copy"
            fi
            echo "Keras $keras $ex, changed lines:"
            diff "$src/examples/ray/$ex" "$copy" | grep '^>' | sed 's/^/    /'
            rm -f "$work"/checkpoint-1.*
            if (cd "$work" && RAY_USAGE_STATS_ENABLED=0 timeout 600 python "$copy") >"$copy.log" 2>&1 \
                    && ls "$work"/checkpoint-1.* >/dev/null 2>&1; then
                echo "    ran to the end: rank 0 saved $(cd "$work" && ls checkpoint-1.*) after its epoch"
            else
                echo "    FAILED:"; grep -v "I0000\|WARNING" "$copy.log" | tail -5 | sed 's/^/    /'; status=1
            fi
        fi
    fi
done
exit $status
