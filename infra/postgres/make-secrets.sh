#!/bin/sh
# Generate the PostgreSQL passwords docker-compose.yml reads as secrets: one random password per role in
# .secrets/postgres/<role>.password. Existing files are kept (delete one to rotate it: docs/security.md).
# The folder is 0700 (no other host user reads the passwords); the files are 0644 because compose bind-mounts
# them into containers that read them as their own users (postgres: uid 999, keel: uid 10001).
set -eu
dir="${1:-.secrets/postgres}"
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
for role in superuser migrate recorder decider auditor; do
    file="$dir/$role.password"
    if [ ! -s "$file" ]; then
        # 43 characters of [A-Za-z0-9]: about 256 bits, and nothing a URL or psql would need to escape.
        LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 43 >"$file.tmp"
        mv "$file.tmp" "$file"
        echo "generated $file"
    fi
    chmod 644 "$file"
done
