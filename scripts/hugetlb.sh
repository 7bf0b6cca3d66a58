# shellcheck shell=bash
# Sourced by the launch scripts: hvdtrain_hugetlb exports GLIBC_TUNABLES with
# glibc.malloc.hugetlb=1 for the ranks they start (TensorFlow's buffers on transparent huge
# pages: Horovod's allreduce 1.4-2.8x faster at 4-64 MiB, docs/performance/speed.md). glibc
# reads the variable only when a process starts, so it goes into the launch's environment.
# The same decision as hvdtrain/base/malloc.py's tunables() (tests/unit/test_malloc.py holds
# them equal): nothing when HVDTRAIN_HUGETLB=0, when GLIBC_TUNABLES already sets
# glibc.malloc.hugetlb (the user's choice, e.g. =0), when glibc is older than 2.35 or when
# transparent huge pages are [never]; otherwise appended to the user's other tunables.
hvdtrain_hugetlb() {
    local version thp
    [[ ${HVDTRAIN_HUGETLB:-} != 0 ]] || return 0
    [[ ":${GLIBC_TUNABLES:-}" != *:glibc.malloc.hugetlb=* ]] || return 0
    version=$(getconf GNU_LIBC_VERSION 2>/dev/null) || return 0  # "glibc 2.36"
    [[ $version =~ ^glibc\ ([0-9]+)\.([0-9]+) ]] || return 0
    ((BASH_REMATCH[1] > 2 || (BASH_REMATCH[1] == 2 && BASH_REMATCH[2] >= 35))) || return 0
    thp=$(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) || return 0
    [[ $thp == *\[* && $thp != *"[never]"* ]] || return 0
    export GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
}
