# Sourced by the study scripts (examples/method_table.sh, examples/long_budget_study.sh) so that
# running a study's command again resumes it. One study per output folder at a time.
#
# Every run of a study goes through `fl-geo run ... --out DIR --resume` (RESUME_FLAG below), whose
# rules (fl_geo/run_reuse.py) are the ones `fl-geo compare --resume` follows:
#   - a run that finished in DIR/<run.name> with the same config is reused, not run again (a
#     finished run of another config there is a one-line error naming the values that differ);
#   - a run interrupted after writing a checkpoint (cells run with `checkpoint_every`) continues
#     from its newest one;
#   - one interrupted before any checkpoint is moved to <name>.interrupted-<epoch seconds> and runs
#     again from the start;
#   - a run still going (its run.lock is held: the same study started twice) is a one-line error
#     naming its pid; it is neither continued nor moved from under its writer.
#
# checkpoint_every ROUNDS: the `run.checkpoint_every` override that gives a run of ROUNDS outer
# steps about 12 checkpoints (at least one per round), so an interrupted study loses under a
# twelfth of a run. Only for cells whose method keeps checkpoints.
RESUME_FLAG="--resume"
checkpoint_every() {
  local k=$(($1 / 12))
  echo "run.checkpoint_every=$((k > 0 ? k : 1))"
}
