#!/usr/bin/env bash
# The scale ladder of docs/benchmarks.md ("Scale ladder"): DiLoCo, FedAvg and Di-PS on the η = 100
# scenario at three model sizes, one size at a time (each `fl-geo compare` runs its three configs
# one after another), then CoCoDC's compensation magnitude at each size and the table and plot.
#   bash examples/scale_ladder.sh            # all three sizes (~40 min on one CPU core)
#   bash examples/scale_ladder.sh S M        # only some
set -euo pipefail
{  # bash reads a script as it runs it: inside one block the whole study is parsed first, so editing
   # this file while a study runs (hours) cannot change or break the running one
cd "$(dirname "$0")/.."
FL=.venv/bin/fl-geo
declare -A SHAPE=(
  [S]="model.n_layers=2 model.d_model=96 model.n_heads=4 client.lr=3e-3"
  [M]="model.n_layers=4 model.d_model=192 model.n_heads=4 client.lr=2e-3"
  [L]="model.n_layers=6 model.d_model=384 model.n_heads=6 client.lr=1e-3"
)
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(S M L)
for s in "${sizes[@]}"; do
  # shellcheck disable=SC2086
  $FL compare configs/bench/ladder_diloco.yaml configs/bench/ladder_fedavg.yaml configs/bench/ladder_dips.yaml \
      ${SHAPE[$s]} run.progress=false --metric bpb --out "runs/ladder_$s"
  # shellcheck disable=SC2086
  .venv/bin/python examples/cocodc_compensation_magnitude.py configs/cocodc.yaml ${SHAPE[$s]} \
      data.tokenizer=bpe data.bpe_vocab_size=2048 client.batch_size=6 client.seq_len=128 streaming.fragments=1 \
      | tee "runs/ladder_$s/cocodc_compensation.txt"
done
.venv/bin/python examples/scale_ladder_report.py runs/ladder_S runs/ladder_M runs/ladder_L --plot docs/img/scale_ladder.png
exit
}
