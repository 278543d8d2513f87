#!/usr/bin/env bash
# The measured rows of the README's "Which method for which situation" table, with 3 seeds and the
# data-parallel reference (ddp) in every comparison, then the table itself:
#
#   bash examples/method_table.sh [OUT]                  # OUT default runs/method-table
#   ROWS="straggler noisy" bash examples/method_table.sh OUT   # some rows only
#   PRINT=1 bash examples/method_table.sh                # the run lines, one per line, nothing run
#   REPORT_ONLY=1 bash examples/method_table.sh OUT      # the table again from the runs in OUT
#   SEED0_ONLY="eta100/dips-paper eta200/ddp" ...        # these cells with seed 0 only
#   KEEP=docs/results/method-table.tar.gz ...            # then keep the finished runs' small files there
#
# Every run goes through `fl-geo run --resume` (examples/study_resume.sh): runs that finished in OUT
# with the same config are reused, so the same command resumes an interrupted study. The long rows'
# cells (every halos and streaming cell: runs of half an hour to 3 hours) write about 12
# checkpoints, and an interrupted one continues from its newest (the asynchronous halos cells resend the jobs that were in flight, so such a resumed
# run is not bit-identical to an uninterrupted one); any other interrupted run is moved aside and
# starts again.
#
# Each row is one comparison of docs/benchmarks.md, run with the configs and budgets of its section
# there, every cell with run.seed 0, 1, ..., SEEDS - 1 (default 3; a seed fixes the initial weights
# and every site's batch order, so the same seed is a paired comparison across cells). The runs go to
# OUT/<row>/runs/<row>-<cell>-seed=<k>, two at a time (one torch thread each). Then
# examples/method_table_report.py reads them and writes OUT/method_table.md (the README table's
# measured rows: each ratio with its 95 % interval and the budget in tokens per parameter) and
# OUT/method_table.json; with README=path it also replaces the table between the README's
# "method-table" markers. A row whose runs are missing keeps the line the README already has for it
# (so ROWS="halos streaming" updates those rows only); with no such line it is left out, with a note.
#
# The ddp cell of a row trains on the same tokens as the row's reference (rounds = its inner steps
# per site) with fp32 gradients, the quality ceiling; its virtual clock charges a ring all-reduce of
# the gradient over the row's scenario every step.
#
# Wall time on a 2-core CPU, two runs at a time: straggler 9 runs ~25 min, eta100 and eta200 12 runs
# each ~35 min, noisy 9 runs ~25 min (2026-11-30); halos 15 runs ~50 min (6-7 min a run) and
# streaming 9 runs ~1.3 h (50-60 s a period, 15-18 min a run; ddp the same) on a 2-core EPYC with
# AVX512 kernels (2026-12-01). With other work on the machine the last two took 4-5 times as long.
set -euo pipefail
{  # bash reads a script as it runs it: inside one block the whole study is parsed first, so editing
   # this file while a study runs (hours) cannot change or break the running one
OUT=${1:-runs/method-table}
FLGEO=${FLGEO:-.venv/bin/fl-geo}
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-3}
ROWS=${ROWS:-straggler eta100 eta200 noisy halos streaming}
SEED0_ONLY=${SEED0_ONLY:-}  # row/cell ... run with seed 0 only (to save time where one seed says enough)
export OMP_NUM_THREADS=1
COMMON="run.progress=false run.tensorboard=false run.sim_cpus=1"
source "$(dirname "$0")/study_resume.sh"  # RESUME_FLAG, checkpoint_every ROUNDS
# ddp: one inner step per round on every site's averaged fp32 gradient, no penalty
DDP="strategy.name=ddp strategy.inner_steps=1 wire.up=fp32 wire.down=fp32"
B=configs/bench
declare -A CELL=(
  # A-EDiT against EDiT under a consistent 3x straggler: 16 rounds of H = 25 (400 steps per site)
  [straggler/edit]="$B/straggler_edit.yaml"
  [straggler/a_edit]="$B/straggler_a_edit.yaml"
  [straggler/ddp]="$B/straggler_edit.yaml $DDP penalty.enabled=false run.rounds=400 run.eval_every=25"
  # Di-PS against synchronous DiLoCo on eta = 100 and 200: 3.28 M tokens (400 steps per site).
  # dips is the config (fl-geo's lr scaling by share, momentum 0.7); dips-paper the paper's 0.8, no scaling
  [eta100/diloco]="$B/eta_diloco.yaml run.scenario=dips_eta100"
  [eta100/dips]="$B/eta_dips.yaml run.scenario=dips_eta100"
  [eta100/dips-paper]="$B/eta_dips.yaml run.scenario=dips_eta100 strategy.outer_lr_scaling=none strategy.outer_momentum=0.8"
  [eta100/ddp]="$B/eta_diloco.yaml run.scenario=dips_eta100 $DDP run.rounds=400 run.eval_every=25"
  [eta200/diloco]="$B/eta_diloco.yaml run.scenario=dips_eta200"
  [eta200/dips]="$B/eta_dips.yaml run.scenario=dips_eta200"
  [eta200/dips-paper]="$B/eta_dips.yaml run.scenario=dips_eta200 strategy.outer_lr_scaling=none strategy.outer_momentum=0.8"
  [eta200/ddp]="$B/eta_diloco.yaml run.scenario=dips_eta200 $DDP run.rounds=400 run.eval_every=25"
  # EDiT against DiLoCo with garbage bursts at one site of four: 24 rounds of H = 25 (600 steps per site)
  [noisy/diloco]="$B/noisy_diloco.yaml"
  [noisy/edit]="$B/noisy_edit.yaml"
  [noisy/ddp]="$B/noisy_diloco.yaml $DDP run.rounds=600 run.eval_every=25"
  # HALoS against Async-Local-SGD and DiLoCo on the HALoS paper topology: 8.19 M tokens (16 workers)
  # halos is the config (K = 4: with the paper's K = 32 the global model takes 17 steps in this budget)
  # (checkpoints: about 12 a run, from the global steps seed 0 took: 68, 15 and 197)
  [halos/halos]="$B/halos_halos.yaml $(checkpoint_every 68)"
  [halos/halos-paper]="$B/halos_halos.yaml halos.accumulate=32 $(checkpoint_every 15)"
  [halos/async_local_sgd]="$B/halos_async_local_sgd.yaml $(checkpoint_every 197)"
  [halos/diloco]="$B/halos_diloco.yaml $(checkpoint_every 8)"
  [halos/ddp]="$B/halos_diloco.yaml $DDP run.rounds=250 run.eval_every=10 $(checkpoint_every 250)"
  # Streaming DiLoCo (alpha 0.5) against DiLoCo on slow_wan: 18 periods of H = 100 (1,800 steps per
  # site, 14.7 M tokens, 37 tokens per parameter: past compute-optimal, and half the cost of the 36
  # periods of the docs' one-seed section, so the three seeds take 6 h, not 12)
  [streaming/diloco]="configs/streaming_diloco.yaml strategy.name=diloco run.rounds=18 run.backend=inline $(checkpoint_every 18)"
  [streaming/streaming]="configs/streaming_diloco.yaml run.rounds=18 run.backend=inline $(checkpoint_every 18)"
  [streaming/ddp]="configs/streaming_diloco.yaml $DDP strategy.outer_optimizer=adamw run.rounds=1800 run.eval_every=100 run.backend=inline $(checkpoint_every 1800)"
)
CELLS_OF_straggler="edit a_edit ddp"
CELLS_OF_eta100="diloco dips dips-paper ddp"
CELLS_OF_eta200="diloco dips dips-paper ddp"
CELLS_OF_noisy="diloco edit ddp"
CELLS_OF_halos="halos halos-paper async_local_sgd diloco ddp"
CELLS_OF_streaming="diloco streaming ddp"
jobs=()
for seed in $(seq 0 $((SEEDS - 1))); do  # seed-major: an interrupted study leaves whole seeds
  for row in $ROWS; do
    cells_var="CELLS_OF_$row"
    [ -n "${!cells_var:-}" ] || { echo "unknown row $row (rows: straggler eta100 eta200 noisy halos streaming)" >&2; exit 2; }
    for c in ${!cells_var}; do
      [[ $seed -gt 0 && " $SEED0_ONLY " == *" $row/$c "* ]] && continue
      jobs+=("${CELL[$row/$c]} $COMMON run.seed=$seed run.name=$row-$c-seed=$seed --out $OUT/$row/runs $RESUME_FLAG")
    done
  done
done
if [ -n "${PRINT:-}" ]; then printf '%s\n' "${jobs[@]}"; exit 0; fi
if [ -z "${REPORT_ONLY:-}" ]; then
  mkdir -p "$OUT"
  printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "$FLGEO run {} > /dev/null 2>> $OUT/study.log" || failed=$?
fi
# the finished runs are kept even when another run failed
if [ -n "${KEEP:-}" ]; then "$PY" examples/keep_results.py "$OUT" "$KEEP"; fi
[ -z "${failed:-}" ] || { echo "some runs failed (exit $failed): see $OUT/study.log" >&2; exit 1; }
"$PY" examples/method_table_report.py "$OUT" ${README:+--readme "$README"}
exit
}
