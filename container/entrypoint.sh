#!/bin/sh
# The container's entry point: a mounted /config/config.toml is the configuration file unless
# EDGE_QUEUE_CONFIG names another; EDGE_QUEUE_* variables override it (docs/configuration.md).
# The first argument is edge-queue's command: serve (the default), up or worker.
set -e
if [ -z "${EDGE_QUEUE_CONFIG:-}" ] && [ -f /config/config.toml ]; then
    export EDGE_QUEUE_CONFIG=/config/config.toml
fi
exec edge-queue "$@"
