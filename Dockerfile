# hvdtrain: the environment scripts/setup.sh makes on a Debian 12 machine, in two stages.
#
#   docker build -t hvdtrain .                       # CPU image (Debian 12)
#   docker run --rm hvdtrain                         # horovodrun -np 2 ... hvdtrain.mnist
#
# The build stage runs scripts/setup.sh (compilers, MPI headers, CMake: Horovod is compiled
# from its sdist with scripts/patches/ applied); the run stage gets the finished .venv and
# only what it needs at run time (Python, Open MPI's runtime and mpirun, ssh for horovodrun -H).
#
# CUDA variant (Horovod with NCCL allreduce, one GPU per process); not built or run by the
# project (its CI machines have no GPU and no Docker engine):
#   docker build -t hvdtrain:gpu \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.5.1-cudnn-devel-ubuntu22.04 \
#     --build-arg RUNTIME_IMAGE=nvidia/cuda:12.5.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg HVDTRAIN_GPU=1 --build-arg PYTHON=python3 .
#   docker run --rm --gpus all hvdtrain:gpu horovodrun -np 2 python -m hvdtrain.mnist
ARG BASE_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12

FROM ${BASE_IMAGE} AS build
ARG HVDTRAIN_GPU=0
ARG PYTHON=python3.11
ENV DEBIAN_FRONTEND=noninteractive HVDTRAIN_GPU=${HVDTRAIN_GPU} PYTHON=${PYTHON}
# setup.sh installs the rest; it needs only bash and apt.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hvdtrain
COPY . .
RUN scripts/setup.sh && rm -rf /root/.cache/pip \
    && find .venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${RUNTIME_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Run time: the interpreter the venv was made with, Open MPI (libmpi for Horovod's MPI
# controller, mpirun), ssh (horovodrun -H), ps (horovodrun), Fashion-MNIST (optional data).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 openmpi-bin \
        openssh-client procps ca-certificates \
    && (apt-get install -y -q --no-install-recommends dataset-fashion-mnist || true) \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hvdtrain
COPY --from=build /opt/hvdtrain /opt/hvdtrain
ENV PATH=/opt/hvdtrain/.venv/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Fails the build if anything the run stage lacks is needed to load Horovod's op library.
RUN python -c "import horovod.tensorflow as hvd; assert hvd.mpi_built() and hvd.gloo_built()" \
    && horovodrun --check-build
CMD ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist"]
