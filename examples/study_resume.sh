# Sourced by the study scripts (examples/method_table.sh, examples/long_budget_study.sh) so that
# running a study's command again resumes it. One study per output folder at a time.
#
# pending RUN_DIR: true when the run in RUN_DIR still has to run. A run that finished (its
# summary.json is written last) is skipped. A run that was interrupted (its folder exists without
# a summary.json) is moved aside to RUN_DIR.interrupted-<epoch seconds>, because `fl-geo run`
# refuses to write over an earlier run's files; it then runs again from the start.
# With DRY set (a study that only prints or reports) nothing is moved.
pending() {
  [ -f "$1/summary.json" ] && return 1
  if [ -e "$1" ] && [ -z "${DRY:-}" ]; then
    mv "$1" "$1.interrupted-$(date +%s)"
    echo "moved the interrupted run $1 aside; it runs again" >&2
  fi
  return 0
}
