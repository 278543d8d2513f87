#!/usr/bin/env bash
# The whole-budget compression study (examples/compression_long_budget.sh: DiLoCo on eta = 100, 50
# outer steps of H = 8, 3.28 M tokens, fp32 and the two sparse codes, 3 seeds) with SparseLoCo's
# outer setting instead of the config's Nesterov (lr 0.7, momentum 0.9): plain averaging, outer lr
# 1 and no momentum, the error-feedback residual carrying what a sparse step leaves out. OUTER and
# TAG try other outer settings. docs/benchmarks.md ("The outer optimizer under sparse updates").
#
#   bash examples/compression_outer_tuning.sh [OUT]     # OUT default runs/compression-outer
#   OUTER="strategy.outer_lr=0.7 strategy.outer_momentum=0.5" TAG=m05 bash examples/compression_outer_tuning.sh
set -euo pipefail
export OUTER=${OUTER:-strategy.outer_lr=1.0 strategy.outer_momentum=0.0}
export TAG=${TAG:-avg}
exec bash "$(dirname "$0")/compression_long_budget.sh" "${1:-runs/compression-outer}"
