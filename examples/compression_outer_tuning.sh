#!/usr/bin/env bash
# Does the sparse codecs' gap at the whole eta = 100 budget (examples/compression_long_budget.sh)
# come from the outer optimizer? SparseLoCo drops DiLoCo's outer Nesterov momentum and lets the
# error-feedback residual carry the delayed part of the update instead. This runs the two sparse
# codes (top-1 % and DCT top-1 %, int2 values, error feedback) at the same budget (50 outer steps
# of H = 8, 3.28 M tokens) with OUTER's outer settings (default: plain averaging, outer lr 1 and
# no momentum), 3 seeds each, two runs at a time, then one table with 95 % intervals. Compare with
# fp32 DiLoCo at its own settings in the long-budget study (docs/benchmarks.md).
#
#   bash examples/compression_outer_tuning.sh [OUT]     # OUT default runs/compression-outer
#   OUTER="strategy.outer_lr=0.7 strategy.outer_momentum=0.5" TAG=m05 bash examples/compression_outer_tuning.sh
set -euo pipefail
OUT=${1:-runs/compression-outer}
FLGEO=${FLGEO:-.venv/bin/fl-geo}
OUTER=${OUTER:-strategy.outer_lr=1.0 strategy.outer_momentum=0.0}
TAG=${TAG:-avg}
export OMP_NUM_THREADS=1
mkdir -p "$OUT/runs"
source "$(dirname "$0")/compression_codecs.sh"  # codec SECTION NAME: one codec's overrides
COMMON="run.sim_cpus=1 run.progress=false run.tensorboard=false strategy.inner_steps=8 run.rounds=50 run.max_tokens=3276800"
jobs=()
for seed in 0 1 2; do
  for codec in topk-int2-ef dct-int2-ef; do
    jobs+=("configs/bench/eta_diloco.yaml $COMMON $OUTER $(codec wire $codec) run.seed=$seed run.name=diloco-$TAG-$codec-seed=$seed")
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "$FLGEO run {} --out $OUT/runs > /dev/null 2>> $OUT/study.log"
"$FLGEO" compare --runs "$OUT"/runs/* --out "$OUT/table"  # each group: mean and 95 % interval
