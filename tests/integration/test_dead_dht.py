"""A DHT read whose DHT process is gone raises instead of hanging (hivemind's ``run_coroutine`` waits forever
on a dead process: ``p2p-diloco swarm`` hung there, deaf to Ctrl+C, when its live view's DHT was killed).

A real hivemind DHT on 127.0.0.1, its process killed by its pid."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hivemind import DHT

from p2p_diloco.net.membership import read_many

pytestmark = pytest.mark.integration
TIMEOUT_S = 2.0
DEADLINE_S = 60.0


def test_a_read_of_a_dead_dht_raises_a_one_line_timeout() -> None:
    dht = DHT(start=True)
    try:
        assert read_many(dht, ["some-key"], timeout_s=DEADLINE_S) == {"some-key": None}  # alive: answers
        os.kill(dht.pid, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S
        while dht.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dht.is_alive()  # the fault fired
        raised: list[BaseException] = []

        def read() -> None:
            try:
                read_many(dht, ["some-key", "other-key"], timeout_s=TIMEOUT_S)
            except BaseException as e:  # handed to the test's thread
                raised.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(DEADLINE_S)
        assert not reader.is_alive(), "read_many of a dead DHT is still waiting"  # it used to wait forever
        assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
        line = str(raised[0])
        assert line == f"a DHT read of 2 keys had no answer in {TIMEOUT_S:g} s (the DHT process is dead)"
    finally:
        if dht.is_alive():
            dht.shutdown()
