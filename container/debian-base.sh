#!/bin/sh
# Debian bookworm's base image from Debian's packages, for where no container registry can be
# reached (container/build.sh with EDGE_QUEUE_BASE=debootstrap; the add-on's test build).
#
#   container/debian-base.sh            imports it as docker.io/library/debian:bookworm-slim
#
# PODMAN as for container/build.sh ("podman" by default, "docker"); ARCH (default: this
# machine's) another Debian architecture, e.g. arm64 (qemu-user-static for its second stage).
# Nothing is done when the image is there already. Needs root (debootstrap).
set -eu
PODMAN=${PODMAN:-podman}
BASE_IMAGE=${BASE_IMAGE:-docker.io/library/debian:bookworm-slim}
if $PODMAN image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    exit 0
fi
root=$(mktemp -d /var/tmp/edge-queue-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase ${ARCH:+--arch="$ARCH"} bookworm "$root/rootfs" http://deb.debian.org/debian >&2
rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/lib/apt/lists/*
platform=""
if [ -n "${ARCH:-}" ]; then
    case "$PODMAN" in *docker*) platform="--platform linux/$ARCH" ;; *) platform="--arch $ARCH" ;; esac
fi
# shellcheck disable=SC2086
tar -C "$root/rootfs" -c . | $PODMAN import $platform - "$BASE_IMAGE" >&2
