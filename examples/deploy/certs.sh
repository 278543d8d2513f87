#!/usr/bin/env bash
# Create the test CA, the SuperLink certificate and one SuperNode key pair per site, once, on a
# trusted machine; then copy to each host only what it needs (docs/deploy.md, "Certificates"):
#   SuperLink host: ca.crt server.crt server.key supernodes/*.pub
#   site <name>:    ca.crt supernodes/<name>.key
# Env (or pass fl-geo deploy certs flags directly, which win):
#   CERTS_DIR   output folder                       (default .flwr-deploy/certs)
#   HOSTS       names/IPs the SuperLink cert covers (default 127.0.0.1,localhost)
#   NODES       site names, one key pair each       (default dc0,dc1,dc2)
# Idempotent: an existing CA and node keys are kept; the server cert is re-issued if HOSTS changed.
set -euo pipefail
CALLER="$PWD"   # relative paths in env vars and arguments are relative to where you ran this
abspath() { case "$1" in /*|"") printf '%s' "$1";; *) printf '%s' "$CALLER/$1";; esac; }
cd "$(dirname "$0")/../.."
exec .venv/bin/fl-geo deploy certs \
  --out "$(abspath "${CERTS_DIR:-$PWD/.flwr-deploy/certs}")" \
  --hosts "${HOSTS:-127.0.0.1,localhost}" \
  --nodes "${NODES:-dc0,dc1,dc2}" "$@"
