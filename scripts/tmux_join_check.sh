#!/usr/bin/env bash
# Ctrl+C on a learner, as a user does it: `p2p-diloco join` in a tmux pane (a real terminal: Ctrl+C is
# SIGINT to the pane's whole foreground process group), then a check that it left within 15 s and
# that nothing of it is left running. Writes results/tmux-join/pane-*.txt and verdict.txt.
#
#   bash scripts/tmux_join_check.sh [SECONDS_OF_TRAINING_BEFORE_CTRL_C]     # default 20
set -euo pipefail
cd "$(dirname "$0")/.."
WAIT_S="${1:-20}"
EXIT_BAR_S=15
OUT=results/tmux-join
RUN=$(mktemp -d /tmp/p2pd-join-XXXXXX)
SESSION="p2pd-join-$$"
mkdir -p "$OUT"
rm -f "$OUT"/pane-*.txt "$OUT"/verdict.txt
command -v tmux >/dev/null || { echo "tmux_join_check: tmux is not installed" >&2; exit 2; }
BOOT_PID=""
cleanup() {
    tmux kill-session -t "$SESSION" 2>/dev/null || true
    [ -n "$BOOT_PID" ] && kill -TERM "$BOOT_PID" 2>/dev/null || true
}
trap cleanup EXIT

# the bootstrap in a session of its own (not part of what we check)
setsid .venv/bin/p2p-diloco bootstrap --config configs/tiny.toml --identity "$RUN/boot.id" > "$RUN/boot.log" 2>&1 &
BOOT_PID=$!
for _ in $(seq 1 120); do grep -q "^ready" "$RUN/boot.log" 2>/dev/null && break; sleep 0.5; done
PEERS=$(sed -n 's/^initial peers: //p' "$RUN/boot.log")
[ -n "$PEERS" ] || { echo "tmux_join_check: the bootstrap did not start" >&2; cat "$RUN/boot.log" >&2; exit 1; }

tmux new-session -d -s "$SESSION" -x 120 -y 40 \
    "cd $(pwd) && .venv/bin/p2p-diloco join --initial-peers $PEERS --config configs/tiny.toml --steps 1000000 --name tmux-learner; echo EXIT=\$? > $RUN/exit; sleep 600"
PANE_PID=$(tmux display-message -p -t "$SESSION" '#{pane_pid}')
PANE_SID=$(ps -o sid= -p "$PANE_PID" | tr -d ' ')
for _ in $(seq 1 240); do tmux capture-pane -p -t "$SESSION" | grep -q "^learner " && break; sleep 0.5; done
sleep "$WAIT_S"
tmux capture-pane -p -t "$SESSION" > "$OUT/pane-before-ctrl-c.txt"
before=$(ps -eo pid=,sid=,args= | awk -v s="$PANE_SID" -v p="$PANE_PID" '$2 == s && $1 != p' | wc -l)
t0=$(date +%s.%N)
tmux send-keys -t "$SESSION" C-c
for _ in $(seq 1 1200); do [ -f "$RUN/exit" ] && break; sleep 0.05; done
t1=$(date +%s.%N)
exit_s=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
sleep 2
tmux capture-pane -p -t "$SESSION" -S -40 > "$OUT/pane-after-ctrl-c.txt"
left=$(ps -eo pid=,sid=,args= | awk -v s="$PANE_SID" -v p="$PANE_PID" '$2 == s && $1 != p && $3 != "sleep"' | wc -l)
code=$(sed -n 's/^EXIT=//p' "$RUN/exit" 2>/dev/null || echo none)
verdict=clean
[ "$code" = "0" ] || verdict="exit code $code"
python3 -c "import sys; sys.exit(0 if $exit_s <= $EXIT_BAR_S else 1)" || verdict="slow: ${exit_s} s"
[ "$left" -eq 0 ] || verdict="$left processes left"
{
    echo "processes of the learner before Ctrl+C: $before"
    echo "exit after Ctrl+C: ${exit_s} s (bar: ${EXIT_BAR_S} s), exit code $code"
    echo "processes left in the pane's session: $left"
    echo "verdict: $verdict"
} | tee "$OUT/verdict.txt"
rm -rf "$RUN"
[ "$verdict" = clean ]
