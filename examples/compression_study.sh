#!/usr/bin/env bash
# The three-seed compression study of docs/benchmarks.md ("Compression, three seeds"): DiLoCo and
# Di-PS on the eta = 100 scenario, HALoS on the HALoS paper topology, each with fp32, bf16, int4,
# int2 + error feedback, top-1 % + int2 + EF and DCT top-1 % + int2 + EF, 3 seeds each (run.seed
# 0, 1, 2), two runs at a time (one per core), then one table with 95 % intervals over all groups.
#
#   bash examples/compression_study.sh [OUT]      # OUT default runs/compression-study
#
# The budgets are fractions of the configs' own (DiLoCo and Di-PS a quarter of eta = 100's 3.28 M
# tokens, DiLoCo with H = 8 so that error feedback gets 12 outer steps; HALoS an eighth of its
# 8.19 M): the 54 runs took 57 minutes on a 2-core CPU.
set -euo pipefail
{  # bash reads a script as it runs it: inside one block the whole study is parsed first, so editing
   # this file while a study runs (hours) cannot change or break the running one
OUT=${1:-runs/compression-study}
FLGEO=${FLGEO:-.venv/bin/fl-geo}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
COMMON="run.sim_cpus=1 run.progress=false run.tensorboard=false"
ETA="run.max_tokens=819200"
HALOS="run.max_tokens=1024000"
source "$(dirname "$0")/compression_codecs.sh"  # codec SECTION NAME: one codec's overrides
jobs=()
for codec in fp32 bf16 int4 int2-ef topk-int2-ef dct-int2-ef; do
  jobs+=("configs/bench/eta_diloco.yaml $COMMON $ETA strategy.inner_steps=8 $(codec wire $codec) run.name=diloco-$codec")
  jobs+=("configs/bench/eta_dips.yaml $COMMON $ETA $(codec wire $codec) run.name=dips-$codec")
  jobs+=("configs/bench/halos_halos.yaml $COMMON $HALOS $(codec halos $codec) run.name=halos-$codec")
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "$FLGEO compare {} --seeds 3 --out $OUT/tables/\$(echo '{}' | sed 's/.*run.name=//') > /dev/null 2>> $OUT/study.log"
"$FLGEO" compare --runs "$OUT"/tables/*/runs/* --out "$OUT/table"  # each group: mean and 95 % interval
exit
}
