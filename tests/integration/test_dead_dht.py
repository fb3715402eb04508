"""A DHT read whose DHT process is gone raises instead of hanging (hivemind's ``run_coroutine`` waits forever
on a dead process: ``p2p-diloco swarm`` hung there, deaf to Ctrl+C, when its live view's DHT was killed).

A real hivemind DHT on 127.0.0.1, its process killed by its pid -- in a Python of its own, not forked from the
test process: hivemind's futures share one ``multiprocessing`` lock among every process forked from the same
parent, and a DHT killed while holding it leaves it held for good, so every later in-process DHT of the suite
hung on its first update (``MPFuture._send_update``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
TIMEOUT_S = 2.0
DEADLINE_S = 60.0

SCRIPT = f"""
import os, signal, threading, time
from hivemind import DHT
from p2p_diloco.net.membership import read_many

dht = DHT(start=True)
try:
    assert read_many(dht, ["some-key"], timeout_s={DEADLINE_S}) == {{"some-key": None}}  # alive: answers
    os.kill(dht.pid, signal.SIGKILL)
    deadline = time.monotonic() + {DEADLINE_S}
    while dht.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("dead" if not dht.is_alive() else "alive", flush=True)  # the fault fired
    raised = []

    def read():
        try:
            read_many(dht, ["some-key", "other-key"], timeout_s={TIMEOUT_S})
        except BaseException as e:  # handed to the main thread
            raised.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join({DEADLINE_S})
    print("waiting" if reader.is_alive() else "returned", flush=True)
    print("raised " + "; ".join(f"{{type(e).__name__}}: {{e}}" for e in raised), flush=True)
finally:
    if dht.is_alive():
        dht.shutdown()
"""


def test_a_read_of_a_dead_dht_raises_a_one_line_timeout() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=3 * DEADLINE_S)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[0] == "dead", lines  # the fault fired
    assert lines[1] == "returned", "read_many of a dead DHT is still waiting"  # it used to wait forever
    assert lines[2] == f"raised TimeoutError: a DHT read of 2 keys had no answer in {TIMEOUT_S:g} s (the DHT process is dead)", lines
