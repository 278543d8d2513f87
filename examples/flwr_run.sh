#!/usr/bin/env bash
# Run fl-geo through Flower's own CLI on a local simulation SuperLink, and stop that SuperLink at
# the end (`flwr run` starts it detached; it would otherwise outlive the command).
#   examples/flwr_run.sh [--run-config 'config="configs/fedavg.yaml" overrides="run.rounds=4"']
#   FLWR_APP_DIR=examples/own-model examples/flwr_run.sh      (another Flower app folder)
# `fl-geo run CONFIG` is the simpler path; this shows the same app works the Flower way.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr}"
export PATH="$PWD/.venv/bin:$PATH"
# The app runs in this venv: never let the SuperLink build a fresh env (it would fetch CUDA torch).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
mkdir -p "$FLWR_HOME"
[ -f "$FLWR_HOME/config.toml" ] || cp examples/flwr_config.toml "$FLWR_HOME/config.toml"
trap 'pkill -f "flower-superlink.*${FLWR_HOME}" || true' EXIT
flwr run "${FLWR_APP_DIR:-.}" fl-geo-local --stream "$@"
