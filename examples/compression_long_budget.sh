#!/usr/bin/env bash
# DiLoCo on the eta = 100 scenario at the config's whole budget (3.28 M tokens: 50 outer steps of
# H = 8, four times the three-seed study's quarter budget), uncompressed and with the two
# sparse codes of that study (top-1 % and DCT top-1 %, int2 values, error feedback), 3 seeds each
# (run.seed 0, 1, 2), two runs at a time (one per core), then one table with 95 % intervals
# (runs named <name>-seed=<k> form one group per codec, as `fl-geo compare --seeds` names them).
# docs/benchmarks.md ("Compression at four times the budget") has the figures.
#
#   bash examples/compression_long_budget.sh [OUT]      # OUT default runs/compression-long
#
# CODECS (the codecs to run), OUTER (extra strategy overrides, e.g. the outer optimizer's), TAG
# (the run names' middle part), SEEDS (default "0 1 2") and ROUNDS (outer steps of H = 8, default 50;
# the token budget follows, 65,536 tokens a step, and so does the inner LR schedule) vary the study;
# examples/compression_outer_tuning.sh sets them. Every run goes through `fl-geo run --resume` and
# keeps about 12 checkpoints, so the same command resumes an interrupted study
# (examples/study_resume.sh).
set -euo pipefail
{  # bash reads a script as it runs it: inside one block the whole study is parsed first, so editing
   # this file while a study runs (hours) cannot change or break the running one
OUT=${1:-runs/compression-long}
FLGEO=${FLGEO:-.venv/bin/fl-geo}
CODECS=${CODECS:-fp32 topk-int2-ef dct-int2-ef}
OUTER=${OUTER:-}
TAG=${TAG:-long}
SEEDS=${SEEDS:-0 1 2}
ROUNDS=${ROUNDS:-50}
export OMP_NUM_THREADS=1
mkdir -p "$OUT/runs"
source "$(dirname "$0")/compression_codecs.sh"  # codec SECTION NAME: one codec's overrides
source "$(dirname "$0")/study_resume.sh"  # RESUME_FLAG, checkpoint_every ROUNDS
COMMON="run.sim_cpus=1 run.progress=false run.tensorboard=false strategy.inner_steps=8 run.rounds=$ROUNDS"
COMMON="$COMMON run.max_tokens=$((ROUNDS * 65536)) $(checkpoint_every "$ROUNDS")"
jobs=()
for seed in $SEEDS; do
  for codec in $CODECS; do
    jobs+=("configs/bench/eta_diloco.yaml $COMMON $OUTER $(codec wire $codec) run.seed=$seed run.name=diloco-$TAG-$codec-seed=$seed")
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "$FLGEO run {} --out $OUT/runs $RESUME_FLAG > /dev/null 2>> $OUT/study.log"
"$FLGEO" compare --runs "$OUT"/runs/* --out "$OUT/table"  # each group: mean and 95 % interval
exit
}
