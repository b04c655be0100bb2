#!/bin/sh
# Build the edge-queue image from this checkout (docs/install.md, "Build the image yourself").
#
#   container/build.sh [tag]           default tag: edge-queue:<version>
#
# PODMAN (default "podman") is the command: "docker" builds with Docker (its classic builder or
# BuildKit), or e.g. "podman --runtime runc --cgroup-manager cgroupfs"; BUILD_OPTS adds options
# to its build (e.g. "--ulimit nofile=4096:4096 --ulimit nproc=4096:4096").
# Where no container registry can be reached, EDGE_QUEUE_BASE=debootstrap builds Debian
# bookworm's base image from Debian's packages first (debootstrap, as root) and imports it under
# the name the Containerfile starts from. A proxy that re-signs TLS: PIP_CERT names the CA
# bundle pip must trust (default: pip's own `cert` setting, when it has one); it is handed to
# the build as container/pip-cert/ca.pem, removed afterwards, and is not in the image.
set -eu
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
BASE_IMAGE=docker.io/library/debian:bookworm-slim
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
tag=${1:-edge-queue:$version}

if [ "${EDGE_QUEUE_BASE:-registry}" = debootstrap ] && ! $PODMAN image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    root=$(mktemp -d /var/tmp/edge-queue-base.XXXXXX)
    debootstrap --variant=minbase bookworm "$root/rootfs" http://deb.debian.org/debian >&2
    rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/lib/apt/lists/*
    tar -C "$root/rootfs" -c . | $PODMAN import - "$BASE_IMAGE" >&2
    rm -rf "$root"
fi

cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
bundle=container/pip-cert/ca.pem
if [ -n "$cert" ] && [ -f "$cert" ] && [ ! -e "$bundle" ]; then
    cp "$cert" "$bundle"
    trap 'rm -f "$bundle"' EXIT
    trap 'rm -f "$bundle"; exit 130' INT TERM
fi
# podman writes OCI images unless told otherwise, and OCI images have no HEALTHCHECK: the docker
# format keeps it (Docker's images always are)
format=""
if $PODMAN --version 2>/dev/null | grep -qi podman; then
    format="--format docker"
fi
# host networking: the build's apt and pip reach their registries as this machine does
# shellcheck disable=SC2086
$PODMAN build $format --network host ${BUILD_OPTS:-} -f container/Containerfile -t "$tag" .
echo "$tag"
