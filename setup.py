"""hvdtrain: synchronous data-parallel SGD for TensorFlow, with Horovod.

The pins are the combination measured to build and train (docs/reference/versions.md):
Horovod 0.28.1 is the last release; scripts/setup.sh compiles it against
TensorFlow 2.21 with two small kept patches (scripts/patches/; the second matters to GPU
builds only). Keras 3 is the default;
tf-keras gives Keras 2 to users who set TF_USE_LEGACY_KERAS=1.

``pip install .`` installs what training needs; the test, bench and docs tools are extras.
Horovod is not a requirement here: it is compiled against the TensorFlow already installed
(``scripts/setup.sh``, which also writes it as a wheel with ``--wheels DIR``), and hvdtrain
trains in one process without it. constraints.txt holds the exact versions the tests pass with.
"""
import os
import re

from setuptools import find_packages, setup

# The version lives in one leaf module that hvdtrain itself reads too.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hvdtrain", "_version.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

setup(
    name="hvdtrain",
    version=VERSION,
    description="Horovod-backed synchronous data-parallel training for TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # Keras 3.15 and NumPy 2.4 need 3.11; TensorFlow 2.21 has no 3.14 wheel.
    python_requires=">=3.11,<3.14",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    package_data={"hvdtrain": ["resources/*.gz", "resources/*.md"]},
    install_requires=[
        # Horovod 0.28.1 compiles against 2.21 once its XLA ops are left out (setup.sh applies
        # scripts/patches/horovod-0.28.1-no-xla-ops.patch). The plain "tensorflow" wheel (not
        # tensorflow-cpu): tf-keras requires it by that name, and it runs on CPU; GPUs come
        # with the "and-cuda" extra (scripts/setup.sh with HVDTRAIN_GPU=1).
        "tensorflow==2.21.0",
        # Keras 3, the default: the version TensorFlow 2.21 resolved to when measured.
        "keras==3.15.1",
        # Keras 2 for users who set TF_USE_LEGACY_KERAS=1 (the same release as TensorFlow).
        "tf-keras==2.21.0",
        # TensorFlow 2.21 no longer brings TensorBoard, which tf.summary needs for the run
        # directory's event files.
        "tensorboard==2.21.0",
        "numpy>=1.26,<2.5",
        # Every process imports ml_dtypes with TensorFlow: 0.7.0 (what pip picks) loads in
        # 1.2 s here, 0.5.4 in 0.15 s (import of hvdtrain.keras with TensorFlow, Keras and
        # Horovod, 4 pairs alternating: 5.3 -> 4.4 s wall median). TensorFlow 2.21 asks for
        # >=0.5.1,<1.0.
        "ml_dtypes>=0.5.1,<0.6",
    ],
    extras_require={
        # hvd.init(comm=MPI.COMM_WORLD) and the allreduce benchmark's reference.
        "mpi": ["mpi4py==4.1.2"],
        # kubernetes-validate: the Kubernetes API schemas for deploy/kubernetes/'s objects;
        # jsonschema: the MPIJob CRD's own schema (tests/clusters/test_k8s.py).
        # pytest-xdist: scripts/test.sh's passes on two workers.
        "test": ["pytest>=7,<9", "pytest-timeout>=2.2", "pytest-xdist>=3.5,<4",
                 "kubernetes-validate>=1.29,<2",
                 "jsonschema>=4.18,<5", "PyYAML>=6",
                 # tests/runs/test_tracking.py: a real MLflow server, W&B offline.
                 "mlflow>=3,<4", "wandb>=0.19,<1",
                 # tests/runs/test_ray.py: Horovod's RayExecutor on a local Ray cluster.
                 "ray==2.60.0",
                 # tests/clusters/test_spark_cluster.py: a standalone Spark cluster (its Java
                 # comes from scripts/setup_test.sh).
                 "pyspark==4.3.0", "fsspec>=2024.6"],
        # --track mlflow / wandb (hvdtrain.engine.tracking): imported only when a run asks.
        "track": ["mlflow>=3,<4", "wandb>=0.19,<1"],
        # Horovod's horovod.ray (RayExecutor, ElasticRayExecutor) on a Ray cluster: Ray 2.60,
        # with scripts/patches/python/horovod-0.28.1-ray2.patch. Plain ray: no dashboard.
        "ray": ["ray==2.60.0"],
        # Horovod's horovod.spark (run, run_elastic, KerasEstimator) and hvdtrain.spark on
        # PySpark 4.3, which needs Java 17 or 21 (Debian: openjdk-17-jre-headless). fsspec: the
        # estimator's Store. Petastorm is not used: its last release imports pyarrow.filesystem,
        # gone from the pyarrow this stack locks (the estimator reads Parquet with pyarrow).
        "spark": ["pyspark==4.3.0", "fsspec>=2024.6"],
        "bench": ["matplotlib>=3.8"],  # python -m hvdtrain.bench's PNG plots
        # The documentation site (mkdocs.yml, docs/): mkdocs build --strict in the quick tests;
        # mkdocstrings renders the API reference (docs/reference/api/) from the docstrings.
        "docs": ["mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0,<2"],
    },
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.__main__:main"]},
)
