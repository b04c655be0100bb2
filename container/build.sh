#!/bin/sh
# Build the edge-queue image from this checkout (docs/install.md, "Build the image yourself").
#
#   container/build.sh [tag]           default tag: edge-queue:<version>
#
# PODMAN (default "podman") is the command, e.g. "podman --runtime runc --cgroup-manager cgroupfs";
# BUILD_OPTS adds options to its build (e.g. "--ulimit nofile=4096:4096 --ulimit nproc=4096:4096").
# Where no container registry can be reached, EDGE_QUEUE_BASE=debootstrap builds Debian
# bookworm's base image from Debian's packages first (debootstrap, as root) and imports it under
# the name the Containerfile starts from. A proxy that re-signs TLS: PIP_CERT names the CA
# bundle pip must trust (default: pip's own `cert` setting, when it has one).
set -eu
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
BASE_IMAGE=docker.io/library/debian:bookworm-slim
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
tag=${1:-edge-queue:$version}

if [ "${EDGE_QUEUE_BASE:-registry}" = debootstrap ] && ! $PODMAN image exists "$BASE_IMAGE"; then
    root=$(mktemp -d /var/tmp/edge-queue-base.XXXXXX)
    debootstrap --variant=minbase bookworm "$root/rootfs" http://deb.debian.org/debian >&2
    rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/lib/apt/lists/*
    tar -C "$root/rootfs" -c . | $PODMAN import - "$BASE_IMAGE" >&2
    rm -rf "$root"
fi

cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
secret=""
if [ -n "$cert" ] && [ -f "$cert" ]; then
    secret="--secret id=pip_cert,src=$cert"
fi
# host networking: the build's apt and pip reach their registries as this machine does;
# the docker format keeps the HEALTHCHECK (OCI images have none)
# shellcheck disable=SC2086
$PODMAN build --format docker --network host ${BUILD_OPTS:-} $secret -f container/Containerfile -t "$tag" .
echo "$tag"
