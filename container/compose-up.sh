#!/usr/bin/env bash
# Start edge-queue with compose after checking that the ports it publishes on this box are
# free and that MEDIA_DIR exists (docs/install.md, "Compose"): a port in use is named, with the
# .env setting that moves it, before anything starts (docker compose would fail half-way,
# podman-compose waits); then the image is built with container/build.sh when it is missing
# (the same image, settings and tag as build.sh's), and compose brings the project up.
#
#   container/compose-up.sh                                      # compose.yaml: mosquitto + hub
#   container/compose-up.sh -f compose.external-broker.yaml      # the hub, for your own broker
#   container/compose-up.sh --profile worker                     # more options: compose's own
#
# Every -f is kept, in order (an override file after the first). COMPOSE is the compose
# command (default: "docker compose", else docker-compose, else podman-compose). A project
# already up is started again without the check (its own containers hold the ports).
# COMPOSE_HTTP_TIMEOUT (docker-compose 1.29's wait for dockerd, 60 s) is 300 unless set (here
# or in .env): on vfs storage dockerd takes longer than a minute to create or remove the 1-GB
# container.
set -euo pipefail
cd "$(dirname "$0")/.."
files=()
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -f | --file) files+=("$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
[ ${#files[@]} -gt 0 ] || files=(compose.yaml)
fargs=()
for f in "${files[@]}"; do fargs+=(-f "$f"); done
if [ -z "${COMPOSE:-}" ]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
    elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
    else COMPOSE=podman-compose
    fi
fi
# the container engine compose drives, for the image check and build.sh
case "$COMPOSE" in
    podman*) ENGINE=${ENGINE:-podman} ;;
    *) ENGINE=${ENGINE:-docker} ;;
esac

# A setting as compose reads it: the environment first, then .env, then the file's default.
setting() {
    local value=${!1:-}
    if [ -z "$value" ] && [ -f .env ]; then
        value=$(sed -n "s/^$1=//p" .env | tail -n1)
    fi
    echo "${value:-$2}"
}
# something accepts connections on this box's port $1 (within 3 s)
listening() { timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

export COMPOSE_HTTP_TIMEOUT
COMPOSE_HTTP_TIMEOUT=$(setting COMPOSE_HTTP_TIMEOUT 300)

# the compose files' text, for what they publish and mount
text=$(cat "${files[@]}")

# shellcheck disable=SC2086
if [ -z "$($COMPOSE "${fargs[@]}" ps -q 2>/dev/null)" ]; then
    taken=0
    for pair in MQTT_PORT:1883 MQTT_WEBSOCKET_PORT:9001 PAGE_PORT:8099 API_PORT:9000; do
        name=${pair%%:*}
        grep -q "\"\${$name:-" <<<"$text" || continue  # not published by these files
        port=$(setting "$name" "${pair#*:}")
        if listening "$port"; then
            echo "edge-queue: port $port on this box is in use ($name): set $name to a free port in .env" >&2
            taken=1
        fi
    done
    if [ "$taken" = 1 ]; then
        if grep -q '"${MQTT_PORT:-' <<<"$text" && listening "$(setting MQTT_PORT 1883)"; then
            echo "edge-queue: an MQTT broker may already run there (Home Assistant's, the NAS's): to use it" \
                "instead of a second one, container/compose-up.sh -f compose.external-broker.yaml" >&2
        fi
        echo "edge-queue: nothing started (docs/install.md, \"Compose\")" >&2
        exit 1
    fi
    if grep -q '${MEDIA_DIR:-' <<<"$text"; then
        media=$(setting MEDIA_DIR ./media)
        if [ ! -d "$media" ]; then
            echo "edge-queue: MEDIA_DIR $media is not a folder on this box: set MEDIA_DIR in .env to the folder" \
                "of your recordings (Docker would mount a new empty one as /media); nothing started" >&2
            exit 1
        fi
    fi
fi

# The image: build.sh's when it is missing (its tag, the one compose.yaml names)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
export EDGE_QUEUE_IMAGE=${EDGE_QUEUE_IMAGE:-$(setting EDGE_QUEUE_IMAGE "edge-queue:$version")}
if ! $ENGINE image inspect "$EDGE_QUEUE_IMAGE" >/dev/null 2>&1; then
    echo "edge-queue: building $EDGE_QUEUE_IMAGE with container/build.sh (a first build takes 10-20 minutes)" >&2
    PODMAN=$ENGINE container/build.sh "$EDGE_QUEUE_IMAGE" >&2
fi
# shellcheck disable=SC2086
exec $COMPOSE "${fargs[@]}" ${args[@]+"${args[@]}"} up -d
