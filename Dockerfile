# hvdtrain: the environment scripts/setup.sh makes on a Debian 12 machine, in two stages.
#
#   docker build -t hvdtrain .                       # CPU image (Debian 12)
#   docker run --rm hvdtrain                         # horovodrun -np 2 ... hvdtrain.mnist
#
# The build stage runs scripts/setup.sh (compilers, MPI headers, CMake: Horovod is compiled
# from its sdist with scripts/patches/ applied); the run stage gets the finished .venv and
# only what it needs at run time (Python, Open MPI's runtime and mpirun, ssh for horovodrun -H).
#
# CUDA variant (Horovod with NCCL allreduce, one GPU per process): the same Debian base and
# the same script with HVDTRAIN_GPU=1, so CUDA comes from PyPI's wheels (TensorFlow's CUDA 12.9
# runtime, cuDNN and NCCL in the venv; nvcc 13.0 only in the build stage, deleted there). No
# vendor base image: the NVIDIA Container Toolkit mounts the host's driver (libcuda) at run time.
#   docker build -t hvdtrain:gpu --build-arg HVDTRAIN_GPU=1 .
#   docker run --rm --gpus all hvdtrain:gpu scripts/gpu_check.sh
# Not yet run on a GPU by this project (no GPU machine with a container runtime here).
#
# Kubernetes (deploy/kubernetes/, an MPIJob of the Kubeflow MPI Operator): the same images,
# run as the user mpiuser (uid 1000; the operator's own non-root pattern). The workers run
# Debian's sshd on port 2222 as that user (scripts/k8s_worker.sh), which the launcher's mpirun
# reaches with the key pair the operator mounts at /home/mpiuser/.ssh; that key is sshd's
# host key too, so the image carries no host key (docs/CLUSTER.md, "Kubernetes").
ARG BASE_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12
ARG HVDTRAIN_GPU=0

FROM ${BASE_IMAGE} AS build
ARG HVDTRAIN_GPU
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
ARG HVDTRAIN_GPU
ENV DEBIAN_FRONTEND=noninteractive
# Run time: the interpreter the venv was made with, Open MPI (libmpi for Horovod's MPI
# controller, mpirun), ssh (horovodrun -H), sshd (an MPIJob's workers), ps and pgrep
# (horovodrun, k8s_worker.sh), Fashion-MNIST (optional data).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 openmpi-bin \
        openssh-client openssh-server procps ca-certificates \
    && (apt-get install -y -q --no-install-recommends dataset-fashion-mnist || true) \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hvdtrain
COPY --from=build /opt/hvdtrain /opt/hvdtrain
# sshd and ssh for an MPIJob: sshd's whole configuration of its own (port 2222, StrictModes
# off for the operator's mounted keys, no PAM), ssh without known_hosts (Debian's ssh_config
# includes ssh_config.d first). No host keys: the package's, made at install, would be every
# pod's of every job; each job's sshd uses the job's key (checked here with a throwaway one).
COPY deploy/kubernetes/ssh/sshd_hvdtrain.conf /etc/ssh/hvdtrain/sshd_config
COPY deploy/kubernetes/ssh/ssh_hvdtrain.conf /etc/ssh/ssh_config.d/hvdtrain.conf
RUN mkdir -p /run/sshd && rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub \
    && ssh-keygen -q -t ecdsa -N "" -f /tmp/hostkey \
    && /usr/sbin/sshd -t -f /etc/ssh/hvdtrain/sshd_config -o HostKey=/tmp/hostkey \
    && rm -f /tmp/hostkey /tmp/hostkey.pub
# The unprivileged user of the MPIJob's pods (runAsUser: 1000); its home holds the job's keys.
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash mpiuser
# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA Container Toolkit gives a container it gives
# GPUs (the CUDA driver and nvidia-smi). Which GPUs is not the image's to say: docker run
# --gpus, or Kubernetes' device plugin for a pod's nvidia.com/gpu limit (NVIDIA_VISIBLE_DEVICES
# =all here would give a pod without that limit every GPU of a node whose default runtime is
# NVIDIA's).
ENV PATH=/opt/hvdtrain/.venv/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Fails the build if anything the run stage lacks is needed to load Horovod's op library.
RUN python -c "import horovod.tensorflow as hvd, sys; \
assert hvd.mpi_built() and hvd.gloo_built() and (hvd.nccl_built() or sys.argv[1] != '1')" \
        "${HVDTRAIN_GPU}" \
    && horovodrun --check-build
CMD ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist"]
