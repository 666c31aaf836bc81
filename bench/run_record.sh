# Sourced by bench/run_distill.sh and bench/run_envs.sh: what each does when one of its runs ends.
# record_run PID DIR NAME START: stop the run's reference server (PID), copy DIR/metrics.jsonl to
# $RESULTS/NAME_metrics.jsonl and write the seconds since START to $RESULTS/NAME_wall_s (a run
# that has its wall seconds there is skipped when the script starts again).
record_run() {
  kill "$1"
  wait "$1" 2>/dev/null || true
  cp "$2/metrics.jsonl" "$RESULTS/$3_metrics.jsonl"
  echo $(( $(date +%s) - $4 )) > "$RESULTS/$3_wall_s"
}
