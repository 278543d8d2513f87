#!/usr/bin/env bash
# Run the SuperLink of a multi-site fl-geo federation on this host, in the foreground (Ctrl-C or
# SIGTERM stops it and its flower-superexec). The ServerApp (outer optimizer) runs here.
#
#   CERTS_DIR=certs examples/deploy/superlink.sh certs/supernodes/*.pub    # TLS + auth (default)
#   INSECURE=1 AUTH=0 SUPERLINK_BIND=127.0.0.1 examples/deploy/superlink.sh   # loopback demo only
#
# Positional arguments: SuperNode public keys (OpenSSH .pub) to register once the SuperLink is up.
# With SuperNode authentication on, only registered keys can join; the SuperLink keeps its state
# in memory, so keys are registered again on every start (set DATABASE to persist it instead).
# Env:
#   SUPERLINK_BIND   address to listen on                    (default 0.0.0.0)
#   SUPERLINK_PORT   the one HTTP port (Fleet/Control/Runtime)  (default 9091)
#   CERTS_DIR        folder with ca.crt server.crt server.key (default .flwr-deploy/certs)
#   AUTH             1 = --enable-supernode-auth             (default 1)
#   INSECURE         1 = no TLS; refused unless SUPERLINK_BIND is a loopback address
#   DATABASE         SQLite file for the SuperLink state     (default: in memory)
#   FLWR_HOME        Flower's home for this SuperLink        (default .flwr-deploy/superlink)
#   CONNECTION       [superlink.<name>] written to $FLWR_HOME/config.toml for `flwr` (default fl-geo)
#   SUPERLINK_ADDRESS  what that connection dials (default 127.0.0.1:$SUPERLINK_PORT; must be in the cert)
set -euo pipefail
CALLER="$PWD"   # relative paths in env vars and arguments are relative to where you ran this
abspath() { case "$1" in /*|"") printf '%s' "$1";; *) printf '%s' "$CALLER/$1";; esac; }
cd "$(dirname "$0")/../.."
ROOT="$PWD"
BIND="${SUPERLINK_BIND:-0.0.0.0}"
PORT="${SUPERLINK_PORT:-9091}"
CERTS_DIR="$(abspath "${CERTS_DIR:-$ROOT/.flwr-deploy/certs}")"
AUTH="${AUTH:-1}"
INSECURE="${INSECURE:-0}"
CONNECTION="${CONNECTION:-fl-geo}"
dial="${SUPERLINK_ADDRESS:-127.0.0.1:$PORT}"
export FLWR_HOME="$(abspath "${FLWR_HOME:-$ROOT/.flwr-deploy/superlink}")"
export PATH="$ROOT/.venv/bin:$PATH"   # the SuperLink starts flower-superexec by name
# The app runs in this venv: never let Flower build a fresh env per app (it would fetch CUDA torch).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

is_loopback() { case "$1" in 127.*|localhost|::1|"[::1]") return 0;; *) return 1;; esac; }

args=(--host "$BIND" --port "$PORT" --disable-runtime-dependency-installation)
[ -n "${DATABASE:-}" ] && args+=(--database "$(abspath "$DATABASE")")
if [ "$INSECURE" = 1 ]; then
  is_loopback "$BIND" || { echo "superlink.sh: INSECURE=1 only on a loopback address (SUPERLINK_BIND=$BIND)" >&2; exit 2; }
  [ "$AUTH" = 1 ] && { echo "superlink.sh: SuperNode auth needs TLS; set AUTH=0 with INSECURE=1" >&2; exit 2; }
  args+=(--insecure)
  conn="insecure = true"
else
  for f in ca.crt server.crt server.key; do
    [ -f "$CERTS_DIR/$f" ] || { echo "superlink.sh: missing $CERTS_DIR/$f (examples/deploy/certs.sh)" >&2; exit 2; }
  done
  args+=(--ssl-certfile "$CERTS_DIR/server.crt" --ssl-keyfile "$CERTS_DIR/server.key" --ssl-ca-certfile "$CERTS_DIR/ca.crt")
  [ "$AUTH" = 1 ] && args+=(--enable-supernode-auth)
  conn="root-certificates = \"$CERTS_DIR/ca.crt\""
fi

# The flwr CLI on this host (flwr run / ls / supernode register) talks to the local SuperLink.
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "$CONNECTION"

[superlink.$CONNECTION]
address = "$dial"
$conn
TOML

flower-superlink "${args[@]}" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM
scheme=https; [ "$INSECURE" = 1 ] && scheme=http
python3=("$ROOT/.venv/bin/python")
for _ in $(seq 1 150); do
  if "${python3[@]}" - "$scheme://$dial/health" "$CERTS_DIR/ca.crt" <<'PY' 2>/dev/null; then break; fi
import ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[1].startswith("https") else None
urllib.request.urlopen(sys.argv[1], timeout=2, context=ctx)
PY
  kill -0 $pid 2>/dev/null || { wait $pid; exit $?; }
  sleep 0.2
done
echo "superlink.sh: SuperLink healthy on $BIND:$PORT (FLWR_HOME=$FLWR_HOME, connection '$CONNECTION')" >&2
for key in "$@"; do
  key="$(abspath "$key")"
  flwr supernode register "$key" "$CONNECTION" --name "$(basename "$key" .pub)" \
    || { echo "superlink.sh: registering $key failed; stopping" >&2; kill -TERM $pid; wait $pid; exit 1; }
done
wait $pid
