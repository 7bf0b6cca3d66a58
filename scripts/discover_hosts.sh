#!/usr/bin/env bash
# Host discovery for elastic runs: horovodrun calls it every few seconds and (re)shapes the
# job to the hosts it prints, one "host:slots" per line.
#
#   HVDTRAIN_HOSTS_FILE=hosts.txt horovodrun -np 2 --min-np 1 --max-np 2 \
#       --host-discovery-script scripts/discover_hosts.sh python -m hvdtrain.mnist --elastic ...
#
# Edit the file while the job runs to add or remove hosts. Without a file it prints this
# machine under two names, one slot each ("localhost:1", "127.0.0.1:1"): Horovod blacklists
# the whole host of a failed worker, so one name per worker lets the others go on.
set -euo pipefail
if [[ -n "${HVDTRAIN_HOSTS_FILE:-}" ]]; then
    grep -v '^\s*\(#\|$\)' "$HVDTRAIN_HOSTS_FILE" || true
else
    printf 'localhost:1\n127.0.0.1:1\n'
fi
