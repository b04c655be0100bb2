#!/bin/sh
# The password file from MQTT_USERS, "user:password" pairs separated by spaces (edge-queue's own
# user first: "edge-queue:<pw> homeassistant:<pw> phone:<pw>"), read on every start: a user
# added to MQTT_USERS is added; a user whose password in MQTT_USERS differs from the file's gets
# the new one, with a line saying so; users added to the file by hand are kept. User names are
# compared exactly and nothing in MQTT_USERS is expanded (no globbing). The example passwords
# (change-me-...) are refused: 1883 and 9001 are published on the LAN without TLS.
# MQTT_PASSWORD_FILE and MOSQUITTO_CONF name other files than the image's (the tests run this
# script outside the image).
set -eu
set -f # a password of '*' is a password, not the names of the files here
file=${MQTT_PASSWORD_FILE:-/mosquitto/config/edge-queue.passwd}
[ -f "$file" ] || : > "$file"
chmod 600 "$file"

# The stored entry of user $1 (everything after "user:"), or nothing: an exact match of the
# name, not a pattern ("a.ice" is not "alice").
stored() {
    awk -F: -v u="$1" '$1 == u { sub(/^[^:]*:/, ""); print; exit }' "$file"
}

# Whether password $2 is the one stored for user $1 (mosquitto 2's "$7$" entries: PBKDF2-SHA512,
# mosquitto_passwd.c); false for an entry in any other format, which is then written again.
same_password() {
    entry=$(stored "$1")
    case "$entry" in '$7$'*) ;; *) return 1 ;; esac
    iterations=$(printf %s "$entry" | cut -d'$' -f3)
    salt=$(printf %s "$entry" | cut -d'$' -f4)
    hash=$(printf %s "$entry" | cut -d'$' -f5)
    hexsalt=$(printf %s "$salt" | base64 -d | od -An -tx1 | tr -d ' \n')
    given=$(openssl kdf -keylen 64 -kdfopt digest:SHA512 -kdfopt "pass:$2" -kdfopt "hexsalt:$hexsalt" \
        -kdfopt "iter:$iterations" -binary PBKDF2 | base64 | tr -d '\n')
    [ "$given" = "$hash" ]
}

for pair in ${MQTT_USERS:-}; do
    user=${pair%%:*}
    pass=${pair#*:}
    if [ -z "$user" ] || [ "$user" = "$pair" ] || [ -z "$pass" ]; then
        echo "MQTT_USERS: '$user' has no password (user:password)" >&2
        exit 2
    fi
    case "$pass" in
        change-me*)
            echo "MQTT_USERS: '$user' still has the example password '$pass': set a password of your own in .env (ports 1883 and 9001 are open to the LAN without TLS)" >&2
            exit 2
            ;;
    esac
    if [ -z "$(stored "$user")" ]; then
        mosquitto_passwd -b "$file" "$user" "$pass"
    elif ! same_password "$user" "$pass"; then
        mosquitto_passwd -b "$file" "$user" "$pass"
        echo "MQTT_USERS: the password of '$user' differs from the one stored: the broker now takes the one in MQTT_USERS" >&2
    fi
done
if [ ! -s "$file" ]; then
    echo "no broker users: set MQTT_USERS=\"edge-queue:<password> ...\" (compose.yaml's .env)" >&2
    exit 2
fi
exec mosquitto -c "${MOSQUITTO_CONF:-/etc/mosquitto/edge-queue.conf}"
