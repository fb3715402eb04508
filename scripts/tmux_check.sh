#!/usr/bin/env bash
# The main job as a new user sees it: `p2p-diloco swarm` inside tmux (a real terminal, so the rich
# live view), snapshots of the pane while it runs, then Ctrl+C, then a check that nothing it started
# is left running. Writes results/tmux/pane-*.txt (what the terminal showed) and results/tmux/verdict.txt.
#
#   bash scripts/tmux_check.sh [SECONDS_BEFORE_CTRL_C]     # default 90
set -euo pipefail
cd "$(dirname "$0")/.."
WAIT_S="${1:-90}"
OUT=results/tmux
RUN=$(mktemp -d /tmp/p2pd-tmux-XXXXXX)
SESSION="p2pd-check-$$"
mkdir -p "$OUT"
rm -f "$OUT"/pane-*.txt "$OUT"/verdict.txt
command -v tmux >/dev/null || { echo "tmux_check: tmux is not installed" >&2; exit 2; }
cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; }
trap cleanup EXIT

p2pd_before=$(ps -eo pid=,args= | awk '$2 ~ /p2pd$/ {print $1}' | sort)
# a 120x40 terminal, like a laptop's; the swarm's own output folder is in $RUN
tmux new-session -d -s "$SESSION" -x 120 -y 40 \
    "cd $(pwd) && .venv/bin/p2p-diloco swarm --minutes 5 --out $RUN/out; echo EXIT=\$? > $RUN/exit; sleep 600"
PANE_PID=$(tmux display-message -p -t "$SESSION" '#{pane_pid}')
echo "tmux_check: swarm started in tmux session $SESSION (shell pid $PANE_PID); Ctrl+C after ${WAIT_S} s"
for t in $(seq 15 15 "$WAIT_S"); do
    sleep 15
    tmux capture-pane -p -t "$SESSION" > "$OUT/pane-$(printf %03d "$t")s.txt"
done
# every process below the pane's shell, before Ctrl+C (the swarm, its learners, their DHT / averager / p2pd)
before=$(ps -eo pid=,ppid=,sid=,args= | awk -v s="$(ps -o sid= -p "$PANE_PID" | tr -d ' ')" '$3 == s' | wc -l)
tmux send-keys -t "$SESSION" C-c
for _ in $(seq 1 120); do [ -f "$RUN/exit" ] && break; sleep 1; done
tmux capture-pane -p -t "$SESSION" -S -60 > "$OUT/pane-after-ctrl-c.txt"
sleep 3
# what is left: processes in the pane's session other than its shell and the final `sleep`, and any
# process anywhere whose command line names this run's folder (learners run in their own sessions)
left_session=$(ps -eo pid=,sid=,args= | awk -v s="$(ps -o sid= -p "$PANE_PID" | tr -d ' ')" -v p="$PANE_PID" \
    '$2 == s && $1 != p && $3 != "sleep"' | wc -l)
left_run=$(ps -eo pid=,args= | grep -F "$RUN" | grep -v -e grep -e "^ *$PANE_PID " -e "tmux new-session" | wc -l || true)  # not the pane's shell
# p2pd daemons that were not there before (run this when no other swarm starts daemons meanwhile)
left_p2pd=$(comm -13 <(echo "$p2pd_before") <(ps -eo pid=,args= | awk '$2 ~ /p2pd$/ {print $1}' | sort) | grep -c . || true)
{
    echo "processes in the pane's session before Ctrl+C: $before"
    echo "swarm exit: $(cat "$RUN/exit" 2>/dev/null || echo 'none within 120 s')"
    echo "left after Ctrl+C: $left_session in the pane's session, $left_run naming the run folder, $left_p2pd new p2pd"
    ps -eo pid=,args= | grep -F "$RUN" | grep -v -e grep -e "^ *$PANE_PID " -e "tmux new-session" | cut -c1-200 | sed 's/^/still running: /' || true
    ls "$RUN/out" 2>/dev/null | sed 's/^/written: /'
    if [ "$left_session" -eq 0 ] && [ "$left_run" -eq 0 ] && [ "$left_p2pd" -eq 0 ] && [ -f "$RUN/exit" ]; then echo "verdict: clean"; else echo "verdict: NOT clean"; fi
} | tee "$OUT/verdict.txt"
