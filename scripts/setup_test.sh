#!/usr/bin/env bash
# The system packages hvdtrain's tests need beyond a user's set-up (scripts/setup.sh); run by
# scripts/test.sh after it. As root on Debian/Ubuntu, apt-get installs what is missing (only
# then); otherwise one install line, and exit 2. HVDTRAIN_SKIP_APT=1: never apt-get.
#   slurmctld slurmd slurm-client munge: tests/clusters/test_slurm.py runs scripts/slurm_job.sh on a
#       two-node SLURM 22.05 cluster of its own (the daemons run only while those tests do);
#       srun --mpi=pmix loads libpmix.so from libpmix-dev, which libopenmpi-dev brings
#   openssh-server openssh-client iproute2: tests/clusters/test_multihost.py runs an sshd per host in
#       network namespaces, reached by horovodrun -H and mpirun over ssh
#   procps: ps and pgrep (the fault tests find ranks); shellcheck: tests/runs/test_scripts.py
#   openjdk-17-jre-headless: the Java that PySpark 4.3 runs on (tests/clusters/test_spark_cluster.py
#       starts a standalone Spark master and two workers, tests/runs/test_spark.py a local Spark)
#   patchelf: scripts/test_gpu_build.sh's GPU build (setup.sh needs it for HVDTRAIN_GPU=1, and
#       runs there with HVDTRAIN_SKIP_APT=1)
#   dataset-fashion-mnist (optional, not in every distribution): the full Fashion-MNIST test
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge openssh-server openssh-client iproute2 procps shellcheck
          patchelf openjdk-17-jre-headless)
optional=(dataset-fashion-mnist)
log() { printf '[setup_test] %s\n' "$*"; }

command -v dpkg-query >/dev/null || { log "no dpkg: install the equivalents of ${packages[*]} yourself"; exit 0; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=() missing_optional=()
for p in "${packages[@]}"; do installed "$p" || missing+=("$p"); done
for p in "${optional[@]}"; do installed "$p" || missing_optional+=("$p"); done
if ((${#missing[@]} == 0 && ${#missing_optional[@]} == 0)); then exit 0; fi
if [[ $(id -u) != 0 || "${HVDTRAIN_SKIP_APT:-0}" == 1 ]] || ! command -v apt-get >/dev/null; then
    if ((${#missing[@]})); then
        log "the tests need: apt-get install ${missing[*]}"
        exit 2
    fi
    log "optional, for the full Fashion-MNIST test: apt-get install ${missing_optional[*]}"
    exit 0
fi
log "installing Debian packages: ${missing[*]} ${missing_optional[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
if ((${#missing[@]})); then apt-get install -y -q --no-install-recommends "${missing[@]}"; fi
for p in "${missing_optional[@]}"; do
    apt-get install -y -q --no-install-recommends "$p" ||
        log "warning: optional package $p unavailable; the Fashion-MNIST test needs --data-dir"
done
