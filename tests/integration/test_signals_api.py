"""Ctrl+C inside ``with DiLoCo(...)`` on the public API, with a round in flight: the learner leaves at once.

A learner script (``Swarm.join``, ``DiLoCo``, a plain loop) trains beside a ``p2p-diloco join`` learner whose
averager stalls in the middle of their shared all-reduce (``stall@while-reducing``): from the moment the fault
fires, the script's round is in flight and cannot end on its own before its sender times out. SIGINT to the
script's process group then must end it within :data:`EXIT_AFTER_SIGINT_S` -- the round cancelled, not waited
for (it took 31-37 s: interpreter exit joined the averaging worker still polling its round) -- with its
tombstone published and nothing of it left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import ProcGroup, start_bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")]

REPO = Path(__file__).resolve().parents[2]
EXIT_AFTER_SIGINT_S = 10.0
"""SIGINT to the process's exit. Issue 49 asked for 5 s, which an idle machine meets (about 2 s); on CI's 2 cores
beside two other workers' learners it once took 5.06 s. What this guards against -- the exit waiting out the
round -- took 31-37 s."""
ROUND_DEADLINE_S = 180.0
"""Start to the stalled all-reduce, generous: two processes' start-up, the wait for peers and the first clock
boundary on a shared 2-core machine."""
STALL_S = 60.0
"""How long the other learner's averager stalls: far longer than our exit may take."""
STALL = f"stall@while-reducing:seconds={STALL_S:g}"
STACKS_WAIT_S = 2.0
"""How long a hung learner gets to write its threads' stacks before the test fails with them."""

LEARNER = """
import faulthandler, logging, signal, sys, time
import torch
from p2p_diloco import DiLoCo, SyncOptions, Swarm, build_model, load_config, training_batches

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s: %(message)s")
faulthandler.register(signal.SIGUSR2, all_threads=True)  # the test asks for every thread's stack if we hang
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever the test runner ignores
cfg = load_config(sys.argv[2])
with Swarm.join([sys.argv[1]], cfg, name="api") as swarm:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    batches = training_batches(cfg, seed=1)
    with DiLoCo(model, opt, swarm, SyncOptions(wait_peers=2)) as diloco:
        diloco.start()
        print("training", flush=True)
        while True:
            x, y = next(batches)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diloco.step(tokens=x.numel(), loss=loss.detach())
            time.sleep(0.05)
"""


def clock_config(tmp: Path) -> Path:
    """tiny on a 4 s swarm clock: both learners' rounds fall due at the same DHT instants."""
    text = (REPO / "configs" / "tiny.toml").read_text()
    old = 'schedule = "steps"  # tests pace learners equally; the clock-schedule tests set "clock"'
    assert old in text
    path = tmp / "tiny-clock.toml"
    path.write_text(text.replace(old, 'schedule = "clock"\nsync_period_s = 4.0\nwindow_max_s = 2.0\nwindow_s = 1.5'))
    return path


def test_sigint_with_a_round_in_flight_exits_at_once(procs: ProcGroup, tmp_path: Path) -> None:
    config = str(clock_config(tmp_path))
    profile = tmp_path / "paced.toml"
    profile.write_text('name = "paced"\nslowdown = 1.0\nmin_step_s = 0.05\nthreads = 1\n')
    peers = start_bootstrap(procs, tmp_path, "--config", config)
    other = procs.cli("join", "--initial-peers", peers, "--config", config, "--name", "other", "--wait-peers", "2",
                      "--profile", str(profile), "--steps", "1000000", "--fault", STALL, name="other")
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    api = procs.start([sys.executable, str(script), peers, config], name="api")
    api.wait_for(r"^training$", timeout_s=ROUND_DEADLINE_S)
    # the other learner's averager received our first part and hangs: our round is mid-all-reduce
    other.wait_for(rf"FAULT fired: {STALL}", timeout_s=ROUND_DEADLINE_S, stream="stderr")
    assert api.alive, api.output()
    signalled = time.monotonic()
    api.kill_group(signal.SIGINT)  # Ctrl+C in a terminal
    try:
        rc = api.popen.wait(timeout=ROUND_DEADLINE_S)
    except subprocess.TimeoutExpired:  # say where it hangs: every thread's stack (faulthandler, on stderr)
        os.kill(api.popen.pid, signal.SIGUSR2)
        time.sleep(STACKS_WAIT_S)
        pytest.fail(f"no exit {ROUND_DEADLINE_S:g} s after SIGINT; its threads:\n{api.output()}")
    finally:
        took_s = time.monotonic() - signalled
    print(f"exit {rc} {took_s:.2f} s after SIGINT")
    assert api.wait_exit(ROUND_DEADLINE_S) == rc
    out = api.output()
    assert api.find(r"cancelled the round in flight of fragment \d"), out  # the fault hit a round in flight
    assert api.find(r"leaving after an error \(KeyboardInterrupt\); tombstone published"), out
    assert took_s < EXIT_AFTER_SIGINT_S, f"exit took {took_s:.1f} s after SIGINT\n{out}"
    api.wait_no_process_left()
    rc, look, _ = procs.run("status", "--initial-peers", peers, "--config", config, "--json")
    assert rc == 0, look.output()
    snapshot = json.loads(look.stdout[-1][1])
    assert {"api": "left"}.items() <= {p["name"]: p["status"] for p in snapshot["peers"]}.items(), snapshot
