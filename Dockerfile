# hvdtrain's images: Debian 12, Horovod's wheel built by scripts/setup.sh, hvdtrain on top.
#
#   docker build -t hvdtrain .                                  # CPU image
#   docker build -t hvdtrain:gpu --build-arg HVDTRAIN_GPU=1 .   # CUDA image (NCCL allreduce)
#   docker run --rm hvdtrain                                    # horovodrun -np 2 ... hvdtrain.mnist
#
# Two stages, ordered so that an edit to hvdtrain rebuilds only the last layers:
# - build: compilers, MPI headers and `scripts/setup.sh --horovod-only`, which makes the venv
#   with the locked run-time stack (constraints.txt) and installs Horovod from the wheel it
#   compiles from the patched sdist. It sees only setup.sh, the patches, pyproject.toml and the
#   lock.
# - run time: Python, Open MPI's runtime and mpirun, ssh and sshd; the build stage's venv; then
#   hvdtrain itself (pip install of this checkout) and its scripts. No compiler, no test tools.
#
# CUDA variant: the same base and script with HVDTRAIN_GPU=1, so CUDA comes from PyPI's wheels
# (TensorFlow's CUDA 12.9 runtime, cuDNN and NCCL in the venv; nvcc 13.0 only in the build
# stage). No vendor base image: the NVIDIA Container Toolkit mounts the host's driver.
#
# The user is mpiuser (uid 1000), whom the MPI Operator's keys are mounted for
# (sshAuthMountPath: /home/mpiuser/.ssh). An MPIJob's workers run Debian's sshd as that user on
# port 2222 (scripts/k8s_worker.sh); the image has no host key: each job's key is its workers'
# host key, or k8s_worker.sh makes one when the worker starts (docs/guides/clusters/kubernetes.md).
#
# Where no registry is reachable, make the base from Debian's packages (scripts/base_image.sh)
# and pass it as BASE_IMAGE. Behind a TLS-intercepting proxy, give pip its CA for the build:
#   -v /etc/ssl/certs/ca-certificates.crt:/run/build-ca.crt:ro --build-arg PIP_CERT=/run/build-ca.crt
ARG BASE_IMAGE=debian:12
ARG HVDTRAIN_GPU=0

FROM ${BASE_IMAGE} AS build
ARG HVDTRAIN_GPU
ARG PIP_CERT=""
ENV DEBIAN_FRONTEND=noninteractive
# What setup.sh checks for (it would install the same as root; listed here so that this layer
# is cached apart from the build).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 python3-venv \
        python3-dev g++ make cmake patch patchelf libopenmpi-dev openmpi-bin ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hvdtrain
COPY pyproject.toml constraints.txt ./
COPY scripts/setup.sh scripts/
COPY scripts/patches/ scripts/patches/
RUN if [ -z "$PIP_CERT" ]; then unset PIP_CERT; fi \
    && HVDTRAIN_GPU=${HVDTRAIN_GPU} HVDTRAIN_VENV=/opt/hvdtrain/.venv HVDTRAIN_BUILD_CACHE=0 \
        PIP_NO_CACHE_DIR=1 scripts/setup.sh --horovod-only \
    && find .venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE_IMAGE}
ARG HVDTRAIN_GPU
ENV DEBIAN_FRONTEND=noninteractive
# Run time: the interpreter the venv was made with, Open MPI (libmpi for Horovod's MPI
# controller, mpirun), ssh (horovodrun -H), sshd (an MPIJob's workers), ps and pgrep
# (horovodrun, k8s_worker.sh), ssh-keygen (a worker's host key), Fashion-MNIST (optional data).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 openmpi-bin \
        openssh-client openssh-server procps ca-certificates \
    && (apt-get install -y -q --no-install-recommends dataset-fashion-mnist || true) \
    && rm -rf /var/lib/apt/lists/*
# sshd and ssh for an MPIJob: sshd's whole configuration of its own (port 2222, StrictModes
# off for the operator's mounted keys, no PAM), ssh without known_hosts (Debian's ssh_config
# includes ssh_config.d first). No host keys: the package's, made at install, would be every
# pod's of every job (the configuration is checked here with a throwaway key).
COPY deploy/kubernetes/ssh/sshd_hvdtrain.conf /etc/ssh/hvdtrain/sshd_config
COPY deploy/kubernetes/ssh/ssh_hvdtrain.conf /etc/ssh/ssh_config.d/hvdtrain.conf
RUN mkdir -p /run/sshd && rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub \
    && ssh-keygen -q -t ecdsa -N "" -f /tmp/hostkey \
    && /usr/sbin/sshd -t -f /etc/ssh/hvdtrain/sshd_config -o HostKey=/tmp/hostkey \
    && rm -f /tmp/hostkey /tmp/hostkey.pub
# The image's user, and the MPIJob's pods' (runAsUser: 1000); its home holds the job's keys.
# Run directories go under /opt/hvdtrain/runs (the default --run-dir; a volume or claim there).
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash mpiuser \
    && install -d -o mpiuser -g mpiuser /opt/hvdtrain/runs
# TensorFlow, Horovod (installed from its wheel) and mpi4py: unchanged by an edit to hvdtrain.
COPY --from=build /opt/hvdtrain/.venv /opt/hvdtrain/.venv
# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA Container Toolkit gives a container it gives
# GPUs (the CUDA driver and nvidia-smi). Which GPUs is not the image's to say: docker run
# --gpus, or Kubernetes' device plugin for a pod's nvidia.com/gpu limit (NVIDIA_VISIBLE_DEVICES
# =all here would give a pod without that limit every GPU of a node whose default runtime is
# NVIDIA's). OMPI_ALLOW_RUN_AS_ROOT: for `docker run --user root`. No GLIBC_TUNABLES: whether
# glibc.malloc.hugetlb=1 helps depends on the node's transparent huge pages, and a value set
# here would look like the user's own; the launch scripts and the ranks themselves add it
# (hvdtrain/base/malloc.py), and HVDTRAIN_HUGETLB=0 turns that off.
ENV PATH=/opt/hvdtrain/.venv/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /opt/hvdtrain
# hvdtrain: a wheel of this checkout, installed without dependencies (the venv has them).
COPY setup.py pyproject.toml README.md /tmp/hvdtrain-src/
COPY hvdtrain/ /tmp/hvdtrain-src/hvdtrain/
RUN cd /tmp/hvdtrain-src && pip install -q --no-deps --no-build-isolation --no-cache-dir \
        --disable-pip-version-check . \
    && cd / && rm -rf /tmp/hvdtrain-src \
    && find /opt/hvdtrain/.venv -name __pycache__ -prune -exec rm -rf {} +
COPY scripts/ /opt/hvdtrain/scripts/
# Fails the build if anything the run stage lacks is needed to load Horovod's op library, or
# if Horovod's wheel does not carry every patch (the doctor's check).
RUN python -c "import horovod.tensorflow as hvd, sys; \
assert hvd.mpi_built() and hvd.gloo_built() and (hvd.nccl_built() or sys.argv[1] != '1')" \
        "${HVDTRAIN_GPU}" \
    && python -m hvdtrain.doctor
USER 1000:1000
CMD ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist"]
