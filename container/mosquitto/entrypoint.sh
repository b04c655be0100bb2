#!/bin/sh
# First start: the password file from MQTT_USERS, "user:password" pairs separated by spaces
# (edge-queue's own user first: "edge-queue:<pw> homeassistant:<pw> phone:<pw>"). Later starts
# keep the file; a user added to MQTT_USERS is added, an existing one keeps its password.
set -eu
file=/mosquitto/config/edge-queue.passwd
[ -f "$file" ] || : > "$file"
chmod 600 "$file"
for pair in ${MQTT_USERS:-}; do
    user=${pair%%:*}
    pass=${pair#*:}
    if [ -z "$user" ] || [ "$user" = "$pair" ] || [ -z "$pass" ]; then
        echo "MQTT_USERS: '$user' has no password (user:password)" >&2
        exit 2
    fi
    grep -q "^$user:" "$file" || mosquitto_passwd -b "$file" "$user" "$pass"
done
if [ ! -s "$file" ]; then
    echo "no broker users: set MQTT_USERS=\"edge-queue:<password> ...\" (compose.yaml's .env)" >&2
    exit 2
fi
exec mosquitto -c /etc/mosquitto/edge-queue.conf
