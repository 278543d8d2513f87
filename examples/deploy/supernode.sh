#!/usr/bin/env bash
# Run one site's SuperNode (its ClientApps train on this host), in the foreground.
#
#   SUPERLINK=link.example.org:9091 SITE=dc0 REGION=eu-west PARTITION_ID=0 NUM_PARTITIONS=3 \
#   DEVICE=cuda ROOT_CERT=certs/ca.crt AUTH_KEY=certs/supernodes/dc0.key examples/deploy/supernode.sh
#
# Env:
#   SUPERLINK        host:port of the SuperLink (required)
#   PARTITION_ID     this site's data partition (required), NUM_PARTITIONS (required)
#   SITE             site name (default dc$PARTITION_ID), REGION (default unknown)
#   DEVICE           auto | cuda | cuda:N | npu | mps | cpu (default auto)
#   PORT             this SuperNode's Runtime API port; one per SuperNode on a host (default 9094)
#   ROOT_CERT        CA certificate that signed the SuperLink's (default .flwr-deploy/certs/ca.crt)
#   AUTH_KEY         this site's private key (default .flwr-deploy/certs/supernodes/$SITE.key);
#                    AUTH_KEY= (empty) connects without SuperNode authentication
#   INSECURE         1 = no TLS; refused unless SUPERLINK is a loopback address
#   EXTRA_NODE_CONFIG  more node config, e.g. 'rack="r7"'
#   FLWR_HOME        Flower's home for this SuperNode (default .flwr-deploy/supernode-$SITE)
set -euo pipefail
CALLER="$PWD"   # relative paths in env vars and arguments are relative to where you ran this
abspath() { case "$1" in /*|"") printf '%s' "$1";; *) printf '%s' "$CALLER/$1";; esac; }
cd "$(dirname "$0")/../.."
ROOT="$PWD"
: "${SUPERLINK:?set SUPERLINK=host:port}"
: "${PARTITION_ID:?set PARTITION_ID}"
: "${NUM_PARTITIONS:?set NUM_PARTITIONS}"
SITE="${SITE:-dc$PARTITION_ID}"
REGION="${REGION:-unknown}"
DEVICE="${DEVICE:-auto}"
PORT="${PORT:-9094}"
INSECURE="${INSECURE:-0}"
export FLWR_HOME="$(abspath "${FLWR_HOME:-$ROOT/.flwr-deploy/supernode-$SITE}")"
export PATH="$ROOT/.venv/bin:$PATH"   # the SuperNode starts flower-superexec by name
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
mkdir -p "$FLWR_HOME"

node_config="partition-id=$PARTITION_ID num-partitions=$NUM_PARTITIONS site=\"$SITE\" region=\"$REGION\" device=\"$DEVICE\""
[ -n "${EXTRA_NODE_CONFIG:-}" ] && node_config="$node_config $EXTRA_NODE_CONFIG"
args=(--superlink "$SUPERLINK" --port "$PORT" --node-config "$node_config")
host="${SUPERLINK%:*}"
if [ "$INSECURE" = 1 ]; then
  case "$host" in
    127.*|localhost|"[::1]") ;;
    *) echo "supernode.sh: INSECURE=1 only for a loopback SuperLink (SUPERLINK=$SUPERLINK)" >&2; exit 2;;
  esac
  args+=(--insecure)
else
  ROOT_CERT="$(abspath "${ROOT_CERT:-$ROOT/.flwr-deploy/certs/ca.crt}")"
  [ -f "$ROOT_CERT" ] || { echo "supernode.sh: missing ROOT_CERT $ROOT_CERT" >&2; exit 2; }
  args+=(--root-certificates "$ROOT_CERT")
  AUTH_KEY="$(abspath "${AUTH_KEY-$ROOT/.flwr-deploy/certs/supernodes/$SITE.key}")"
  if [ -n "$AUTH_KEY" ]; then
    [ -f "$AUTH_KEY" ] || { echo "supernode.sh: missing AUTH_KEY $AUTH_KEY" >&2; exit 2; }
    args+=(--auth-supernode-private-key "$AUTH_KEY")
  fi
fi
echo "supernode.sh: $SITE ($REGION, partition $PARTITION_ID/$NUM_PARTITIONS, $DEVICE) -> $SUPERLINK" >&2
exec flower-supernode "${args[@]}"
