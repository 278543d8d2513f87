#!/usr/bin/env bash
# The long-budget study of docs/benchmarks.md ("DiLoCo against FedAvg at 20 tokens per parameter"):
# the scale ladder's smallest model (S: 2 x 96, 418,272 parameters with the 2,048-token BPE) on the
# eta = 100 scenario, trained on 8,601,600 tokens, 20.6 tokens per parameter: 2,800 inner steps per
# site, so 112 outer steps of H = 25 or 28 of H = 100. Every cell has the same budget, inner AdamW
# and schedule; only the outer step and H differ.
#
#   bash examples/long_budget_study.sh [OUT]       # OUT default runs/long-budget; about 2 h on a 2-core CPU
#   SIZE=M bash examples/long_budget_study.sh OUT  # the ladder's M model (4 x 192, 2,164,416 parameters) at
#                                                  # 2.13 tokens per parameter: 1,500 inner steps per site
#                                                  # (60 outer steps of H = 25, 15 of H = 100); 40 min a
#                                                  # run two at a time (measured 2026-11-30), ~5 h in all
#
# Each cell runs with run.seed 0, then the HEADLINE cells again with seeds 1 and 2 (3 seeds each),
# two runs at a time (one per core), then one table with the 95 % intervals (`fl-geo compare`
# groups <name>-seed=<k>). CELLS and HEADLINE choose cells by name; PRINT=1 prints the run lines
# (config and overrides, one per line) instead of running them. Every run goes through
# `fl-geo run --resume` and keeps about 12 checkpoints, so the same command resumes an interrupted
# study: runs that finished in OUT with the same config are reused, each interrupted run continues
# from its newest checkpoint (examples/study_resume.sh). KEEP=docs/results/<study>.tar.gz adds
# every finished run's four small files to that archive at the end (examples/keep_results.py; docs/results/README.md).
set -euo pipefail
{  # bash reads a script as it runs it: inside one block the whole study is parsed first, so editing
   # this file while a study runs (hours) cannot change or break the running one
OUT=${1:-runs/long-budget}
FLGEO=${FLGEO:-.venv/bin/fl-geo}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
SIZE=${SIZE:-S}
case "$SIZE" in
  # S: 2,800 inner steps per site x 4 sites x 6 x 128 tokens = 8,601,600 tokens, 20.6 per parameter;
  # an evaluation every 175 inner steps per site at H = 25 (16 in a run); every 200 at H = 10, 50
  # and 100 (the few-step end, Hfew: H = 560, 5 outer steps, every step evaluated)
  S) STEPS=2800 EVAL=175 EV25=7 EV50=4 EV100=2 EV10=20 HFEW=560 MODEL="model.n_layers=2 model.d_model=96 model.n_heads=4 client.lr=3e-3" ;;
  # M (the ladder's lr for it): 1,500 steps = 4,608,000 tokens, 2.13 per parameter; 15 evaluations
  # (Hfew: H = 500, 3 outer steps)
  M) STEPS=1500 EVAL=100 EV25=4 EV50=2 EV100=1 EV10=10 HFEW=500 MODEL="model.n_layers=4 model.d_model=192 model.n_heads=4 client.lr=2e-3" ;;
  *) echo "SIZE must be S or M, got $SIZE" >&2; exit 2 ;;
esac
TOKENS=$((STEPS * 4 * 6 * 128))
COMMON="$MODEL run.max_tokens=$TOKENS run.progress=false run.tensorboard=false"
source "$(dirname "$0")/study_resume.sh"  # RESUME_FLAG, checkpoint_every ROUNDS
# every cell keeps about 12 checkpoints, so an interrupted study resumes each run where it stopped
H25="strategy.inner_steps=25 run.rounds=$((STEPS / 25)) run.eval_every=$EV25 $(checkpoint_every $((STEPS / 25)))"
H50="strategy.inner_steps=50 run.rounds=$((STEPS / 50)) run.eval_every=$EV50 $(checkpoint_every $((STEPS / 50)))"
H100="strategy.inner_steps=100 run.rounds=$((STEPS / 100)) run.eval_every=$EV100 $(checkpoint_every $((STEPS / 100)))"
H10="strategy.inner_steps=10 run.rounds=$((STEPS / 10)) run.eval_every=$EV10 $(checkpoint_every $((STEPS / 10)))"
HFEW_="strategy.inner_steps=$HFEW run.rounds=$((STEPS / HFEW)) run.eval_every=1 $(checkpoint_every $((STEPS / HFEW)))"
declare -A CELL=(
  [fedavg-H25]="configs/bench/ladder_fedavg.yaml $H25"
  [diloco-H25]="configs/bench/ladder_diloco.yaml $H25"
  # the data-parallel reference: one AdamW step on the sites' mean gradient per round, fp32 gradients
  [ddp]="configs/bench/ladder_fedavg.yaml strategy.name=ddp strategy.inner_steps=1 run.rounds=$STEPS run.eval_every=$EVAL wire.up=fp32 $(checkpoint_every $STEPS)"
  [diloco-lr0.7-m0.5-H25]="configs/bench/ladder_diloco.yaml $H25 strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [diloco-lr1-m0.5-H25]="configs/bench/ladder_diloco.yaml $H25 strategy.outer_lr=1.0 strategy.outer_momentum=0.5"
  # FedAvgM at its paper's setting (the registry default until 2026-12-01): heavy-ball, lr 1, momentum 0.9
  [fedavgm-H25]="configs/bench/ladder_fedavg.yaml $H25 strategy.name=fedavgm strategy.outer_lr=1.0 strategy.outer_momentum=0.9"
  # the same outer multiplier lr / (1 - momentum) = 1.4 as diloco-lr0.7-m0.5 by other routes: heavy-ball
  # instead of Nesterov, and momentum 0.9 with a five-times-smaller lr; whether the multiplier alone decides
  [fedavgm-lr0.7-m0.5-H25]="configs/bench/ladder_fedavg.yaml $H25 strategy.name=fedavgm strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [diloco-lr0.14-m0.9-H25]="configs/bench/ladder_diloco.yaml $H25 strategy.outer_lr=0.14 strategy.outer_momentum=0.9"
  # H = 50, the registry's default H: the outer step the defaults would give, at the H they give it
  [fedavg-H50]="configs/bench/ladder_fedavg.yaml $H50"
  [diloco-H50]="configs/bench/ladder_diloco.yaml $H50"
  [diloco-lr0.7-m0.5-H50]="configs/bench/ladder_diloco.yaml $H50 strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [fedavg-H100]="configs/bench/ladder_fedavg.yaml $H100"
  [diloco-H100]="configs/bench/ladder_diloco.yaml $H100"
  [diloco-lr0.7-m0.5-H100]="configs/bench/ladder_diloco.yaml $H100 strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  # the two ends of H: many short rounds (H = 10) and a handful of long ones (Hfew, per size above)
  [fedavg-H10]="configs/bench/ladder_fedavg.yaml $H10"
  [diloco-H10]="configs/bench/ladder_diloco.yaml $H10"
  [fedavg-Hfew]="configs/bench/ladder_fedavg.yaml $HFEW_"
  [diloco-Hfew]="configs/bench/ladder_diloco.yaml $HFEW_"
  # momentum 0.5 at both ends too: whether the best outer momentum moves with H
  [diloco-lr0.7-m0.5-H10]="configs/bench/ladder_diloco.yaml $H10 strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [diloco-lr0.7-m0.5-Hfew]="configs/bench/ladder_diloco.yaml $HFEW_ strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  # fedavgm's registry default (heavy-ball 0.7 / 0.5) across H: whether the default chosen at H = 25 holds
  [fedavgm-lr0.7-m0.5-H10]="configs/bench/ladder_fedavg.yaml $H10 strategy.name=fedavgm strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [fedavgm-lr0.7-m0.5-H50]="configs/bench/ladder_fedavg.yaml $H50 strategy.name=fedavgm strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [fedavgm-lr0.7-m0.5-H100]="configs/bench/ladder_fedavg.yaml $H100 strategy.name=fedavgm strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
  [fedavgm-lr0.7-m0.5-Hfew]="configs/bench/ladder_fedavg.yaml $HFEW_ strategy.name=fedavgm strategy.outer_lr=0.7 strategy.outer_momentum=0.5"
)
# The first study ran these; diloco-lr1-m0.5-H25 and fedavgm-H25 ran later with CELLS= and HEADLINE= set to them
CELLS=${CELLS:-fedavg-H25 diloco-H25 ddp diloco-lr0.7-m0.5-H25 fedavg-H100 diloco-H100}
HEADLINE=${HEADLINE-fedavg-H25 diloco-H25 ddp diloco-lr0.7-m0.5-H25}
jobs=()
add() {  # add CELL SEED
  [ -n "${CELL[$1]:-}" ] || { echo "unknown cell $1 (cells: ${!CELL[*]})" >&2; exit 2; }
  jobs+=("${CELL[$1]} $COMMON run.seed=$2 run.name=$1-seed=$2")
}
for c in $CELLS; do add "$c" 0; done
for seed in 1 2; do for c in $HEADLINE; do add "$c" "$seed"; done; done
if [ -n "${PRINT:-}" ]; then printf '%s\n' "${jobs[@]}"; exit 0; fi
mkdir -p "$OUT/runs"
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "$FLGEO run {} --out $OUT/runs $RESUME_FLAG > /dev/null 2>> $OUT/study.log" \
  || failed=$?
# the finished runs are kept even when another run failed
if [ -n "${KEEP:-}" ]; then "$PY" examples/keep_results.py "$OUT" "$KEEP"; fi
[ -z "${failed:-}" ] || { echo "some runs failed (exit $failed): see $OUT/study.log" >&2; exit 1; }
"$FLGEO" compare --runs "$OUT"/runs/*-seed=[0-9] --out "$OUT/table"  # each group of seeds: mean and 95 % interval
exit
}
