# hvdtrain: the same environment scripts/setup.sh makes on a Debian 12 machine.
#
#   docker build -t hvdtrain .                       # CPU image (Debian 12)
#   docker run --rm hvdtrain                         # horovodrun -np 2 ... hvdtrain.mnist
#
# CUDA variant (Horovod with NCCL allreduce, one GPU per process); not built or tested on
# the project's CPU-only CI machines:
#   docker build -t hvdtrain:gpu \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.5.1-cudnn-devel-ubuntu22.04 \
#     --build-arg HVDTRAIN_GPU=1 --build-arg PYTHON=python3 .
#   docker run --rm --gpus all hvdtrain:gpu horovodrun -np 2 python -m hvdtrain.mnist
ARG BASE_IMAGE=debian:12
FROM ${BASE_IMAGE}

ARG HVDTRAIN_GPU=0
ARG PYTHON=python3.11
ENV DEBIAN_FRONTEND=noninteractive \
    HVDTRAIN_GPU=${HVDTRAIN_GPU} \
    PYTHON=${PYTHON}

# setup.sh installs the rest; it needs only bash and apt.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/hvdtrain
COPY . .
RUN scripts/setup.sh && rm -rf /root/.cache/pip /var/lib/apt/lists/*

ENV PATH=/opt/hvdtrain/.venv/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
CMD ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist"]
