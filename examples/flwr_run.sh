#!/usr/bin/env bash
# Any Flower app folder through Flower's own CLI on a local simulation SuperLink, stopped at the end
# (`flwr run` starts it detached; it would otherwise outlive the command).
#   FLWR_APP_DIR=examples/own-model examples/flwr_run.sh --run-config 'num-server-rounds=3'
#   examples/flwr_run.sh --run-config 'run.rounds=4 strategy.inner_steps=10'      (fl-geo's own app)
# For fl-geo's own app `fl-geo flwr-run CONFIG key=value ...` does the same and sizes the
# federation from the config's run.num_clients; here FLWR_NUM_SUPERNODES (default 4) sets it, and
# FLWR_SIM_CPUS (default 2) the Ray CPUs, one actor each (an actor is a process that imports the app).
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr}"
export PATH="$PWD/.venv/bin:$PATH"
# The app runs in this venv: never let the SuperLink build a fresh env (it would fetch CUDA torch).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
NODES="${FLWR_NUM_SUPERNODES:-4}"
CPUS="${FLWR_SIM_CPUS:-2}"
mkdir -p "$FLWR_HOME"
trap 'pkill -f "flower-superlink.*${FLWR_HOME}" || true' EXIT
# Flower >= 1.42 has --federation-config; the installed version tells (asking `flwr run --help`
# would start a process that imports Flower's CLI).
if python -c 'import sys; from importlib.metadata import version as v
sys.exit(tuple(int(x) for x in v("flwr").split(".")[:2]) < (1, 42))'; then
    printf '[superlink]\ndefault = "fl-geo-local"\n\n[superlink.fl-geo-local]\naddress = ":local:"\n' \
        > "$FLWR_HOME/config.toml"
    flwr run "${FLWR_APP_DIR:-.}" fl-geo-local --stream \
        --federation-config "num-supernodes=$NODES backend=\"ray\" init-args-num-cpus=$CPUS client-resources-num-cpus=1" "$@"
else  # Flower 1.41 reads the same settings from the connection's options
    sed -e "s/^options.num-supernodes = .*/options.num-supernodes = $NODES/" \
        -e "s/^options.backend.init-args.num-cpus = .*/options.backend.init-args.num-cpus = $CPUS/" \
        examples/flwr_config.toml > "$FLWR_HOME/config.toml"
    flwr run "${FLWR_APP_DIR:-.}" fl-geo-local --stream "$@"
fi
