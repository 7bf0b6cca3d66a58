"""hvdtrain: synchronous data-parallel SGD for TensorFlow, with Horovod.

The pins are the combination measured to build and train (see README, "Supported
versions"): Horovod 0.28.1 is the last release and compiles only against
TensorFlow <= 2.18; Keras 3 (TensorFlow's default since 2.16) breaks Horovod's
optimizer wrapper, so Keras 2 comes from tf-keras.

Horovod is an extra, not a hard requirement: it is compiled against the
TensorFlow already installed (``pip install --no-build-isolation``, which
``scripts/setup.sh`` does), and hvdtrain trains in one process without it.
"""
from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Horovod-backed synchronous data-parallel training for TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9,<3.13",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    package_data={"hvdtrain": ["resources/*.gz", "resources/*.md"]},
    install_requires=[
        # 2.19+ fails Horovod 0.28.1's build (xla_mpi_ops.cc includes headers the wheel
        # lacks); 2.18.1 is the newest that builds and trains. The plain "tensorflow" wheel
        # (not tensorflow-cpu): tf-keras requires it by that name, and it runs on CPU; GPUs
        # come with the "and-cuda" extra (scripts/setup.sh with HVDTRAIN_GPU=1).
        "tensorflow==2.18.1",
        # Keras 2 for TF 2.18; Keras 3 fails at Horovod's first step.
        "tf-keras==2.18.0",
        # Keras 3 stays installed (TensorFlow requires it; horovod.tensorflow.keras imports
        # its backend module): capped at the newest release seen to import with TF 2.18.
        "keras>=3.5,<3.16",
        "numpy>=1.26,<2.1",
    ],
    extras_require={
        # Built from source against the installed TensorFlow: see scripts/setup.sh.
        "horovod": ["horovod==0.28.1"],
        # hvd.init(comm=MPI.COMM_WORLD) and the allreduce benchmark's reference.
        "mpi": ["mpi4py==4.1.2"],
        "test": ["pytest>=7,<9", "pytest-timeout>=2.2"],
        "bench": ["matplotlib>=3.8"],  # python -m hvdtrain.bench's PNG plots
    },
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.__main__:main"]},
)
