#!/usr/bin/env bash
# Start edge-queue with compose after checking that the ports it publishes on this box are
# free (docs/install.md, "Compose"): a port in use is named, with the .env setting that moves
# it, before anything starts (docker compose would fail half-way, podman-compose waits).
#
#   container/compose-up.sh                                      # compose.yaml: mosquitto + hub
#   container/compose-up.sh -f compose.external-broker.yaml      # the hub, for your own broker
#   container/compose-up.sh --profile worker                     # more options: compose's own
#
# COMPOSE is the compose command (default: "docker compose", else docker-compose, else
# podman-compose). A project already up is started again without the check (its own
# containers hold the ports).
set -euo pipefail
cd "$(dirname "$0")/.."
file=compose.yaml
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -f | --file) file=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -z "${COMPOSE:-}" ]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
    elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
    else COMPOSE=podman-compose
    fi
fi

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

# shellcheck disable=SC2086
if [ -z "$($COMPOSE -f "$file" ps -q 2>/dev/null)" ]; then
    taken=0
    for pair in MQTT_PORT:1883 MQTT_WEBSOCKET_PORT:9001 PAGE_PORT:8099 API_PORT:9000; do
        name=${pair%%:*}
        grep -q "\"\${$name:-" "$file" || continue  # not published by this file
        port=$(setting "$name" "${pair#*:}")
        if listening "$port"; then
            echo "edge-queue: port $port on this box is in use ($name): set $name to a free port in .env" >&2
            taken=1
        fi
    done
    if [ "$taken" = 1 ]; then
        if grep -q '"${MQTT_PORT:-' "$file" && listening "$(setting MQTT_PORT 1883)"; then
            echo "edge-queue: an MQTT broker may already run there (Home Assistant's, the NAS's): to use it" \
                "instead of a second one, container/compose-up.sh -f compose.external-broker.yaml" >&2
        fi
        echo "edge-queue: nothing started (docs/install.md, \"Compose\")" >&2
        exit 1
    fi
fi
# shellcheck disable=SC2086
exec $COMPOSE -f "$file" ${args[@]+"${args[@]}"} up -d
