#!/usr/bin/env bash
# A Debian base image made from Debian's own packages, for building hvdtrain's images where no
# image registry is reachable (or where the base must be built, not pulled): debootstrap's
# minimal system, with the release's updates and security suites, imported into podman or
# docker as one layer.
#
#   scripts/base_image.sh [SUITE [TAG]]       # default: bookworm  localhost/hvdtrain-base:bookworm
#   podman build --build-arg BASE_IMAGE=localhost/hvdtrain-base:bookworm -t hvdtrain .
#
# Needs root (debootstrap makes device nodes and owns files as root), debootstrap, and podman
# or docker. Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

suite=${1:-bookworm}
tag=${2:-localhost/hvdtrain-base:$suite}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
die() { printf 'base_image.sh: error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (debootstrap); run it as root or use a registry's debian:$suite"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
engine=$(command -v podman || command -v docker || true)
[[ -n $engine ]] || die "neither podman nor docker found"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
echo "base_image.sh: debootstrap --variant=minbase $suite from $mirror" >&2
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; die "debootstrap $suite failed (log above)"; }
# The suites an image of the release has: the release, its updates, its security fixes.
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian}/debian-security $suite-security main
EOF
# What a container image leaves out: package lists, caches, logs; no recommends by default.
echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/90hvdtrain-no-recommends"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log \
    "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" --numeric-owner -c . | "$engine" import \
    --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$tag" >/dev/null
echo "base_image.sh: $tag ($("$engine" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}'))"
