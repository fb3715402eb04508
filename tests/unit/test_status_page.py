"""``status --serve`` and ``join --metrics prometheus:PORT`` without a swarm (issue 36): where they may listen, what
they refuse (one line, exit 2, before anything starts), and what a real server answers for a real status read."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.cli.serve import StatusServer
from p2p_diloco.core.events import EvalEvent, ResyncEvent, RoundEvent
from p2p_diloco.engine.metrics import PrometheusSink, parse_metrics_spec
from p2p_diloco.net.dashboard import ServeAddress, parse_serve_address
from p2p_diloco.net.records import LocalRun, PeerRecord, PeerView
from p2p_diloco.net.report import snapshot_json
from procs import UNREACHABLE_PEER as PEER
from test_cli_inputs import TINY


@pytest.mark.parametrize("text, host, port, public", [
    ("8080", "127.0.0.1", 8080, False),
    ("127.0.0.1:8080", "127.0.0.1", 8080, False),
    ("localhost:8080", "localhost", 8080, False),
    ("[::1]:8080", "::1", 8080, False),
    ("0.0.0.0:8080", "0.0.0.0", 8080, True),
    ("[::]:8080", "::", 8080, True),
])
def test_serve_addresses_this_machine_or_every_interface_said_explicitly(text: str, host: str, port: int,
                                                                          public: bool) -> None:
    address = parse_serve_address(text, "--serve")
    assert (address.host, address.port, address.public) == (host, port, public)
    assert address.url().startswith("http://") and address.url().endswith(f":{port}/")


@pytest.mark.parametrize("text, expected", [
    ("192.168.1.5:8080", "say so explicitly with --serve 0.0.0.0:8080"),
    ("example.com:8080", "is not this machine's loopback"),
    ("http", "expected [HOST:]PORT"),
    ("0", "PORT in 1-65535"),
    ("70000", "PORT in 1-65535"),
    (":8080", "no host before ':'"),
])
def test_serve_address_refusals_name_the_flag(text: str, expected: str) -> None:
    with pytest.raises(ValueError, match="--serve") as e:
        parse_serve_address(text, "--serve")
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_status_serve_on_a_lan_host_or_a_taken_port_is_refused(refused: Callable[..., str],
                                                                held_port: socket.socket) -> None:
    status = ["status", "--initial-peers", PEER, "--serve"]
    refused([*status, "192.168.1.5:8080"], "--serve 192.168.1.5:8080: ", "--serve 0.0.0.0:8080")
    port = held_port.getsockname()[1]
    refused([*status, str(port)], f"--serve 127.0.0.1:{port}: port {port} is already in use")


def test_join_metrics_prometheus_refusals(refused: Callable[..., str], held_port: socket.socket) -> None:
    join = ["join", "--initial-peers", PEER, "--config", TINY, "--metrics"]
    port = held_port.getsockname()[1]
    refused([*join, f"prometheus:{port}"], f"--metrics prometheus:127.0.0.1:{port}: port {port} is already in use")
    refused([*join, "prometheus:10.0.0.1:9100"], "--metrics prometheus:10.0.0.1:9100: ", "prometheus:0.0.0.0:9100")
    refused([*join, "prometheus:"], "needs a port")
    refused([*join, "prometheus:abc"], "expected [HOST:]PORT")


def test_swarm_serve_refusals(refused: Callable[..., str], held_port: socket.socket) -> None:
    refused(["swarm", "--config", "tiny", "--serve", "10.1.2.3:8080"], "0.0.0.0:8080")
    port = held_port.getsockname()[1]
    refused(["swarm", "--config", "tiny", "--serve", str(port)], f"port {port} is already in use")


# ---------------------------------------------------------------- a real server over a real read


def _record(name: str, peer_id: str, versions: tuple[int, ...], loss: float, now: float) -> PeerRecord:
    return PeerRecord(run_id="r", protocol_version=1, config_hash="abc", software_version="0.1.0", peer_id=peer_id,
                      name=name, profile="fast", addresses=("/ip4/127.0.0.1/tcp/1",), state="training",
                      inner_step=40, tokens=40_960, tokens_per_s=1234.5, fragment_versions=versions,
                      anchor_hashes=tuple("0123456789abcdef" for _ in versions), last_sync_time=now - 3,
                      bytes_sent=5_000_000, bytes_received=4_000_000, loss=loss, time=now - 1)


def _read(now: float, loss_a: float) -> dict:
    from p2p_diloco.net.membership import SwarmSnapshot

    records = [_record("a", "12D3KooWAAAAAAAAAA", (3, 2), loss_a, now), _record("b", "12D3KooWBBBBBBBBBB", (3, 1), 2.5, now)]
    views = tuple(PeerView(r, now + 30, "live") for r in records)
    return snapshot_json(SwarmSnapshot(now, LocalRun("r", 1, "abc", "0.1.0"), views, {"r": 2}), {"read": 0.01})


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_the_server_answers_the_latest_read_its_history_and_its_prometheus_figures() -> None:
    with StatusServer(ServeAddress("127.0.0.1", 0)) as server:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(base + "/api/status")[0] == 503  # no read yet
        first, second = _read(1000.0, 3.0), _read(1002.0, 2.8)
        server.update(first)
        server.update(second)
        code, kind, body = _get(base + "/api/status")
        assert code == 200 and kind == "application/json" and json.loads(body) == json.loads(json.dumps(second))
        history = json.loads(_get(base + "/api/history")[2])
        assert [p["loss"]["a"] for p in history["points"]] == [3.0, 2.8]
        assert history["points"][-1]["rounds"] == 3 + 2 and history["consensus"].startswith("f0 v3: 2/2 peers identical")
        code, kind, page = _get(base + "/")
        assert code == 200 and kind.startswith("text/html") and "loss-chart" in page
        assert "http://" not in page.replace("http://www.w3.org/2000/svg", ""), "the page fetches nothing elsewhere"
        code, kind, text = _get(base + "/metrics")
        assert code == 200 and kind.startswith("text/plain; version=0.0.4")
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("p2p_diloco_swarm_live_peers", (("run", "r"),))] == 2
        assert samples[("p2p_diloco_swarm_tokens_total", (("run", "r"),))] == 2 * 40_960
        assert samples[("p2p_diloco_fragment_version", (("fragment", "1"), ("run", "r")))] == 2
        assert samples[("p2p_diloco_peer_loss", (("peer", "a"), ("peer_id", "AAAAAAAA"), ("run", "r")))] == 2.8
        assert samples[("p2p_diloco_swarm_consensus", (("run", "r"),))] == 1.0
        assert _get(base + "/nothing")[0] == 404
        post = urllib.request.Request(base + "/api/status", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:  # read-only
            urllib.request.urlopen(post, timeout=10)
        assert e.value.code == 501


def _round(outcome: str, step: int, t: float) -> RoundEvent:
    return RoundEvent(fragment=0, version=step, reason="ok", group_size=2, peers=("a", "b"), own_share=0.5,
                      weights=(0.5, 0.5), bytes_sent=1000, bytes_received=900, duration_s=1.5, arrival_spread_s=None,
                      window_s=2.0, allreduce_s=0.5, rtt_s=None, timeouts=None, version_after=step + 1,
                      group_distance=None, outcome=outcome, anchor_hash="0123456789abcdef", tokens_sent=100,
                      steps_sent=10).stamped(name="l0", step=step, tokens=step * 100, time=t, loss=3.0 - step / 100)


def test_the_prometheus_sink_serves_a_learners_figures(free_port: int) -> None:
    spec = parse_metrics_spec(f"prometheus:{free_port}")
    assert spec.address == ServeAddress("127.0.0.1", free_port) and spec.text == f"prometheus:127.0.0.1:{free_port}"
    assert spec.address is not None
    sink = PrometheusSink(spec.address)
    try:
        sink.write(_round("committed", 10, 100.0))
        sink.write(_round("discarded", 20, 102.0))
        sink.write(_round("committed", 30, 104.0))
        sink.write(EvalEvent(eval_loss=2.6, train_s=4.0, versions=(2,), batches=2).stamped(
            name="l0", step=31, tokens=3100, time=104.5, loss=2.7))
        sink.write(ResyncEvent(fragment=0, outcome="rebased", bytes=777).stamped(
            name="l0", step=32, tokens=3200, time=105.0, loss=2.69))
        text = _get(f"http://127.0.0.1:{free_port}/metrics")[2]
    finally:
        sink.close()
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "peer"))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.labels.get("peer") == "l0"}
    assert samples[("p2p_diloco_learner_rounds_total", (("outcome", "committed"),))] == 2
    assert samples[("p2p_diloco_learner_rounds_total", (("outcome", "discarded"),))] == 1
    assert samples[("p2p_diloco_learner_bytes_total", (("direction", "sent"), ("purpose", "averaging")))] == 3000
    assert samples[("p2p_diloco_learner_bytes_total", (("direction", "received"), ("purpose", "state_download")))] == 777
    assert samples[("p2p_diloco_learner_eval_loss", ())] == 2.6
    assert samples[("p2p_diloco_learner_loss", ())] == 2.69
    assert samples[("p2p_diloco_learner_tokens_total", ())] == 3200
    assert samples[("p2p_diloco_learner_tokens_per_second", ())] == pytest.approx(200.0)  # (3200 - 3000) tokens / 1 s


def test_the_prometheus_sink_serves_the_loops_own_figures(free_port: int) -> None:
    """``join --metrics prometheus:PORT`` shows the learner's utilization: a figure of its loop, not of an event,
    read at each scrape (``DiLoCo.watch``)."""
    spec = parse_metrics_spec(f"prometheus:{free_port}")
    assert spec.address is not None
    sink = PrometheusSink(spec.address)
    share = [None, 0.25]
    try:
        sink.write(_round("committed", 10, 100.0))
        sink.watch("utilization", "share of the training time in inner steps", lambda: share[0])
        first = _get(f"http://127.0.0.1:{free_port}/metrics")[2]
        share[0] = share[1]
        second = _get(f"http://127.0.0.1:{free_port}/metrics")[2]
    finally:
        sink.close()

    def utilization(text: str) -> list[float]:
        return [s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "p2p_diloco_learner_utilization" and s.labels.get("peer") == "l0"]

    assert utilization(first) == [] and utilization(second) == [0.25]
