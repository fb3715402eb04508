"""The tests of ``tests/unit/test_private_swarm.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace
import pytest
from test_private_swarm import CFG, Neighbours, Probe, clock_off_by
import test_private_swarm

pytestmark = pytest.mark.integration
swarms = test_private_swarm.swarms
"""The module-scoped fixture of the two swarms (defined beside their helpers; pytest finds it here by name)."""


def test_outsiders_are_refused_at_every_layer_and_the_swarms_never_touch(swarms: SimpleNamespace) -> None:
    from p2p_diloco.averaging.decisions import averager_prefix
    from p2p_diloco.net.records import run_key
    from p2p_diloco.net.probes import dht_refusals
    from p2p_diloco.net.membership import visible_addresses

    dhts, a1 = swarms.dhts, swarms.a1
    ids = {name: dht.peer_id.to_base58() for name, dht in dhts.items()}
    side = {"a1": "a", "a2": "a", "b1": "b", "o": "o"}

    def cross(name: str, found: set[str]) -> set[str]:
        return {n for n, pid in ids.items() if pid in found and side[n] != side[name]}

    # before anyone probes: no peer of one swarm in the other's routing tables or libp2p connections
    neighbours = {name: dht.run_coroutine(Neighbours()) for name, dht in dhts.items()}
    assert ids["a2"] in neighbours["a1"][0], neighbours  # the inspection itself sees members
    for name, (table, connected) in neighbours.items():
        assert not cross(name, table) and not cross(name, connected), (name, neighbours)

    # the outsiders know a1's full address, the run id, its DHT key and the averager prefix
    target = dict(target=ids["a1"], maddrs=tuple(m.split("/p2p/")[0] for m in visible_addresses(dhts["a1"])),
                  prefix=averager_prefix(CFG.run.run_id, 0), run_key=run_key(CFG.run.run_id, ids["a1"]))
    for outsider in ("o", "b1"):
        refused0, dht_refused0 = a1.refusals(), dht_refusals(dhts["a1"])
        got = dhts[outsider].run_coroutine(Probe(**target))
        refused, dht_refused = a1.refusals() - refused0, dht_refusals(dhts["a1"]) - dht_refused0
        print(f"\n{outsider}: saw {got}; a1 refused {refused} averaging and {dht_refused} DHT request(s)")
        # the outsider's side: nothing but refusals (the refusal code of the stream-stream call can be lost, as
        # the handler closes the stream without reading it: then nothing, or a closed stream)
        assert got["state_messages"] == 0 and got["join"] == ["PROTOCOL_VIOLATION"], got
        assert all(c == "PROTOCOL_VIOLATION" or c.startswith("closed: ") for c in got["parts"]), got
        assert got["dht_find"] is None and got["dht_store"] is None, got
        # the member's side: each request counted (and logged with the outsider's peer id)
        assert refused == 3 and dht_refused >= 2, (refused, dht_refused)
    logged = swarms.log_path.read_text()
    for outsider in ("o", "b1"):
        for what in ("a state download", "a join request", "tensor parts"):
            assert f"refused {what} from {ids[outsider]}: not a member of the run" in logged, logged

    # control: a member asking the same way gets the state, and nothing is refused
    refused0 = a1.refusals()
    assert dhts["a2"].run_coroutine(Probe(**target, state_only=True))["state_messages"] > 0
    assert a1.refusals() == refused0

    # afterwards: the outsiders reached a1 over libp2p (no pre-shared key there) but never its DHT
    for name, dht in dhts.items():
        table, _connected = dht.run_coroutine(Neighbours())
        assert not cross(name, table), (name, table)
    _, a1_connected = dhts["a1"].run_coroutine(Neighbours())
    assert {ids["o"], ids["b1"]} <= a1_connected  # connected, yet kept out of the DHT by the swarm key


@pytest.mark.parametrize("swarm,offset_s", [(None, 10.0), ("a", 120.0), ("a", -7200.0), ("a", 7200.0)])
def test_a_clock_beyond_the_dht_tolerance_fails_the_join_with_one_line(swarms: SimpleNamespace, swarm: str | None,
                                                                      offset_s: float) -> None:
    """Open and private swarms; +-120 s and +-2 h pass hivemind's 60 s request window and the 1 h token
    expiry, which alone would make a private swarm answer "swarm key mismatch"."""
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.membership import ClockSkewError, SwarmOptions, start_dht, visible_addresses

    target = swarms.dhts["a1" if swarm else "o"]
    opts = SwarmOptions(initial_peers=parse_initial_peers(visible_addresses(target)[:1]),
                        swarm_key=swarms.keys[swarm] if swarm else None)
    t0 = time.monotonic()
    with clock_off_by(offset_s), pytest.raises(ClockSkewError) as caught:
        start_dht(opts, CFG.run.run_id).shutdown()
    line = str(caught.value)
    print(f"\n{swarm or 'open'} {offset_s:+g} s: refused in {time.monotonic() - t0:.1f} s: {line}")
    m = re.search(r"our clock is ([\d.]+) s (ahead of|behind) an initial peer", line)
    assert m is not None and "\n" not in line, line
    # less the ping's round trip: a second or more when the suite's parallel workers load the machine
    assert float(m.group(1)) == pytest.approx(abs(offset_s), abs=5.0)
    assert m.group(2) == ("ahead of" if offset_s > 0 else "behind")

