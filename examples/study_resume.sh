# Sourced by the study scripts (examples/method_table.sh, examples/long_budget_study.sh) so that
# running a study's command again resumes it. One study per output folder at a time.
#
# pending RUN_DIR: true when the run in RUN_DIR still has to run, and sets RESUME to the override
# that run needs ("run.resume=true" or nothing).
#   - A run that finished (its summary.json is written last) is skipped.
#   - A run that was interrupted after writing a checkpoint (RUN_DIR/checkpoints/ckpt-*.pt, cells
#     run with `checkpoint_every`) continues from its newest one: RESUME=run.resume=true. fl-geo
#     checks that the checkpoint was written by the same run configuration.
#   - A run that was interrupted before any checkpoint (or whose cell keeps none) is moved aside
#     to RUN_DIR.interrupted-<epoch seconds>, because `fl-geo run` refuses to write over an
#     earlier run's files; it then runs again from the start.
#   - A run that is still going (its run.lock is held: the same study started twice) is skipped:
#     neither continued nor moved from under its writer.
# With DRY set (a study that only prints or reports) nothing is moved.
#
# checkpoint_every ROUNDS: the `run.checkpoint_every` override that gives a run of ROUNDS outer
# steps about 12 checkpoints (at least one per round), so an interrupted study loses under a
# twelfth of a run. Only for cells whose method keeps checkpoints.
RESUME=""
pending() {
  RESUME=""
  [ -f "$1/summary.json" ] && return 1
  if [ -f "$1/run.lock" ] && command -v flock > /dev/null && ! flock -n "$1/run.lock" true; then
    echo "skipped $1: a run is still going there ($(head -c 100 "$1/run.lock"))" >&2
    return 1  # another study's run holds it: neither continued nor moved from under its writer
  fi
  if compgen -G "$1/checkpoints/ckpt-*.pt" > /dev/null; then
    RESUME="run.resume=true"
    [ -n "${DRY:-}" ] || echo "resuming the interrupted run $1 from its newest checkpoint" >&2
    return 0
  fi
  if [ -e "$1" ] && [ -z "${DRY:-}" ]; then
    mv "$1" "$1.interrupted-$(date +%s)"
    echo "moved the interrupted run $1 aside; it runs again" >&2
  fi
  return 0
}
checkpoint_every() {
  local k=$(($1 / 12))
  echo "run.checkpoint_every=$((k > 0 ? k : 1))"
}
