#!/bin/sh
# Build the edge-queue image from this checkout (docs/install.md, "Build the image yourself").
#
#   container/build.sh [tag ...]       default tag: edge-queue:<version>
#
# PODMAN (default "podman") is the command: "docker" builds with Docker (its classic builder or
# BuildKit), or e.g. "podman --runtime runc --cgroup-manager cgroupfs"; BUILD_OPTS adds options
# to its build (e.g. "--ulimit nofile=4096:4096 --ulimit nproc=4096:4096").
# Where no container registry can be reached, EDGE_QUEUE_BASE=debootstrap builds Debian
# bookworm's base image from Debian's packages first (debootstrap, as root) and imports it under
# the name the Containerfile starts from. A proxy that re-signs TLS: PIP_CERT names the CA
# bundle pip must trust (default: pip's own `cert` setting, when it has one); it is handed to
# the build as container/pip-cert/ca.pem, removed afterwards, and is not in the image.
# PLATFORM (e.g. "linux/amd64,linux/arm64") builds for those platforms: with Docker through its
# buildx plugin (QEMU for a platform not the machine's; a multi-platform image is pushed with
# BUILD_OPTS=--push, it cannot be loaded), with podman its --platform (.github/workflows/release.yml).
set -eu
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
BASE_IMAGE=docker.io/library/debian:bookworm-slim
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
if [ $# -eq 0 ]; then
    set -- "edge-queue:$version"
fi

if [ "${EDGE_QUEUE_BASE:-registry}" = debootstrap ]; then
    PODMAN="$PODMAN" BASE_IMAGE="$BASE_IMAGE" container/debian-base.sh
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
# host networking: the build's apt and pip reach their registries as this machine does (buildx's
# builder has a network of its own, and host networking only as an entitlement)
build="$PODMAN build $format --network host"
if [ -n "${PLATFORM:-}" ]; then
    if [ -n "$format" ]; then
        build="$build --platform $PLATFORM"
    else
        build="$PODMAN buildx build --platform $PLATFORM"
    fi
fi
tags=""
for tag in "$@"; do
    tags="$tags -t $tag"
done
# shellcheck disable=SC2086
$build ${BUILD_OPTS:-} -f container/Containerfile $tags .
echo "$1"
