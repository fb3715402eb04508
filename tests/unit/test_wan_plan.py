"""``scripts/wan/``'s pure parts: names, address plan, tc arguments, leftovers, run budgets and metrics.

No root actions, no processes: the plan is checked as data (the commands that would run)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from typing import Any

import pytest

from scripts_loader import load_script

netns = load_script("wan/netns.py", "netns")
dp_gloo = load_script("wan/dp_gloo.py", "dp_gloo")
# scripts/wan/bench_wan.py's plan, figures and page: the sibling modules it imports
wan_params = load_script("wan/wan_params.py", "wan_params")
wan_metrics = load_script("wan/wan_metrics.py", "wan_metrics")
wan_page = load_script("wan/wan_page.py", "wan_page")


# ---------------------------------------------------------------- names and addresses


def test_every_name_is_prefixed_and_fits_an_interface_name() -> None:
    plan = netns.WanPlan(hosts=netns.MAX_HOSTS, rate_mbit=10)
    names = [netns.bridge_name()] + [f(i) for i in range(plan.hosts)
                                     for f in (netns.netns_name, netns.inner_if, netns.outer_if)]
    assert all(n.startswith(netns.PREFIX) for n in names)
    assert all(len(n) <= netns.IFNAME_MAX for n in names if not n.startswith(netns.PREFIX + "h"))
    assert len(set(names)) == len(names)


def test_addresses_are_distinct_private_and_inside_the_subnet() -> None:
    plan = netns.WanPlan(hosts=4, rate_mbit=10)
    addrs = [netns.host_address(plan, i) for i in range(4)]
    assert addrs == ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.4"]
    assert netns.host_cidr(plan, 3) == "10.77.0.4/24"
    other = netns.WanPlan(hosts=2, rate_mbit=10, subnet="192.168.250.0/30")
    assert [netns.host_address(other, i) for i in range(2)] == ["192.168.250.1", "192.168.250.2"]
    with pytest.raises(ValueError, match="host index"):
        netns.host_address(plan, 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"hosts": 0, "rate_mbit": 10}, "hosts"),
    ({"hosts": 4, "rate_mbit": 0}, "rate_mbit"),
    ({"hosts": 4, "rate_mbit": 10, "subnet": "8.8.8.0/24"}, "private"),
    ({"hosts": 4, "rate_mbit": 10, "subnet": "127.0.0.0/8"}, "private"),
    ({"hosts": 4, "rate_mbit": 10, "subnet": "10.77.0.1/24"}, "IPv4 network"),
    ({"hosts": 3, "rate_mbit": 10, "subnet": "10.77.0.0/30"}, "room for 2"),
    ({"hosts": 4, "rate_mbit": 10, "burst_ms": 0}, "burst_ms"),
    ({"hosts": 4, "rate_mbit": 10, "queue_ms": -1}, "queue_ms"),
])
def test_impossible_plans_fail_with_one_line_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        netns.WanPlan(**kwargs)


# ---------------------------------------------------------------- tc and the set-up commands


def test_tbf_rate_burst_and_queue() -> None:
    plan = netns.WanPlan(hosts=2, rate_mbit=200)
    args = netns.tbf_args(plan, "p2pd-wan-n0")
    assert args[:6] == ["qdisc", "replace", "dev", "p2pd-wan-n0", "root", "tbf"]
    assert args[args.index("rate") + 1] == "200000kbit"
    assert int(args[args.index("burst") + 1]) == 125_000  # 5 ms at 25 MB/s
    assert args[args.index("latency") + 1] == "100ms"
    slow = netns.WanPlan(hosts=2, rate_mbit=2)
    assert netns.burst_bytes(slow) == 10 * netns.MTU_FRAME_BYTES  # 5 ms at 2 Mbit/s is under one frame: floor
    assert netns.tbf_args(netns.WanPlan(hosts=2, rate_mbit=0.5), "x")[7] == "500kbit"


def test_setup_limits_both_directions_of_every_host_and_touches_only_our_names() -> None:
    plan = netns.WanPlan(hosts=3, rate_mbit=10)
    cmds = netns.setup_commands(plan)
    tbf = [c for c in cmds if c[0] == "tc"]
    devs = sorted(c[c.index("dev") + 1] for c in tbf)
    assert devs == sorted([netns.inner_if(i) for i in range(3)] + [netns.outer_if(i) for i in range(3)])
    inside = [c for c in tbf if c[1] == "-n"]  # the namespace end: what the host sends
    assert [c[2] for c in inside] == [netns.netns_name(i) for i in range(3)]
    # every object named in a command is ours, and no command gives the bridge an address or a route
    for c in cmds:
        named = [a for a in c if a.startswith("p2pd") or a in ("eth0", "lo")]
        assert all(a.startswith(netns.PREFIX) or (a == "lo" and "-n" in c) for a in named), c
        assert "route" not in c
        assert not (c[:3] == ["ip", "addr", "add"])  # addresses only inside namespaces (ip -n NS addr add)
    addrs = [c[c.index("add") + 1] for c in cmds if "addr" in c]
    assert all(ipaddress.ip_interface(a).network == ipaddress.IPv4Network(plan.subnet) for a in addrs)
    # the bridge exists before any port joins it; each namespace before its veth end moves into it
    assert cmds.index(["ip", "link", "add", netns.bridge_name(), "type", "bridge"]) == 0
    for i in range(3):
        add_ns = cmds.index(["ip", "netns", "add", netns.netns_name(i)])
        veth = next(k for k, c in enumerate(cmds) if "veth" in c and netns.inner_if(i) in c)
        assert add_ns < veth


def test_exec_prefix_runs_inside_the_host() -> None:
    assert netns.exec_prefix(2) == ["ip", "netns", "exec", "p2pd-wan-h2"]


# ---------------------------------------------------------------- clean-up and counters


def test_leftovers_are_ours_only_and_the_bridge_goes_last() -> None:
    ns_text = "p2pd-wan-h1 (id: 4)\nother-ns (id: 1)\np2pd-wan-h0\n\n"
    link_json = json.dumps([{"ifname": n} for n in ["lo", "eth0", "p2pd-wan-br", "p2pd-wan-v1", "docker0",
                                                    "p2pd-wan-v0", "p2pd-wanX"]])
    ns, links = netns.leftovers(netns.parse_netns_list(ns_text), netns.parse_link_names(link_json))
    assert ns == ["p2pd-wan-h0", "p2pd-wan-h1"]
    assert links == ["p2pd-wan-v0", "p2pd-wan-v1", "p2pd-wan-br"]
    assert netns.leftovers([], netns.parse_link_names("")) == ([], [])


def test_byte_delta_and_counters_going_backwards() -> None:
    assert netns.byte_delta({"tx_bytes": 10, "rx_bytes": 5}, {"tx_bytes": 110, "rx_bytes": 5}) == {
        "tx_bytes": 100, "rx_bytes": 0}
    with pytest.raises(netns.WanError, match="went backwards"):
        netns.byte_delta({"tx_bytes": 10}, {"tx_bytes": 3})


# ---------------------------------------------------------------- data-parallel decisions


def test_dp_params_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        dp_gloo.DpParams(config="c", rank=4, world_size=4)
    with pytest.raises(ValueError, match="compute-only"):
        dp_gloo.DpParams(config="c", compute_only=True, world_size=4)
    with pytest.raises(ValueError, match="threads"):
        dp_gloo.DpParams(config="c", threads=0)


def test_dp_stop_eval_and_target() -> None:
    assert dp_gloo.should_stop(20, 20, 1.0, 0.0)
    assert not dp_gloo.should_stop(19, 20, 1e9, 0.0)  # no time budget: only the step budget
    assert dp_gloo.should_stop(5, 20, 30.0, 30.0)
    assert dp_gloo.is_eval_step(7, 7, 50) and dp_gloo.is_eval_step(50, 600, 50)
    assert not dp_gloo.is_eval_step(49, 600, 50) and not dp_gloo.is_eval_step(50, 600, 0)
    curve = [{"train_s": 0.0, "eval_loss": 5.3}, {"train_s": 10.0, "eval_loss": 2.4}, {"train_s": 20.0, "eval_loss": 1.9}]
    assert dp_gloo.time_to_target(curve, 2.0) == 20.0
    assert dp_gloo.time_to_target(curve, 1.0) is None
    s = dp_gloo.summarize_steps([9.0, 5.0, 1.0, 2.0, 3.0])
    assert s["median_step_s"] == 2.0 and s["mean_step_s"] == 2.0  # the first two (warm-up) left out


# ---------------------------------------------------------------- benchmark plan and metrics


def test_bench_budget_is_checked_up_front() -> None:
    p = wan_params.BenchParams(rates_mbit=(10.0,), methods=("dp",), dp_max_time_s=60)
    slack = wan_params.START_SLACK_S + wan_params.FINISH_SLACK_S
    once = wan_params.START_SLACK_S + 2 * p.compute_steps + slack + wan_params.TRAJECTORY_STEP_S * p.trajectory_steps
    assert wan_params.worst_case_s(p) == pytest.approx(once + 60 + slack)
    assert wan_params.worst_case_s(dataclasses.replace(p, merge=True)) == pytest.approx(60 + slack)
    with pytest.raises(ValueError, match="exceeds the budget"):
        wan_params.BenchParams(rates_mbit=(2.0, 10.0))  # two rates with every method
    with pytest.raises(ValueError, match="methods must be"):
        wan_params.BenchParams(rates_mbit=(10.0,), methods=("ring",))
    with pytest.raises(ValueError, match="rate_mbit"):
        wan_params.BenchParams(rates_mbit=(0.0,), methods=("dp",))
    with pytest.raises(ValueError, match="trajectory_steps >= 1"):
        wan_params.BenchParams(methods=("dp",), trajectory_steps=0)


def test_one_rate_with_every_method_fits_in_30_minutes_once_the_reference_runs_are_done() -> None:
    assert wan_params.worst_case_s(wan_params.BenchParams(merge=True)) <= 30 * 60
    assert wan_params.worst_case_s(wan_params.BenchParams(methods=("dp",))) <= 30 * 60


def test_trajectory_steps_and_tokens_to_target() -> None:
    pts = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    t = wan_metrics.trajectory_summary([{"step": s, "tokens": s * 8192, "eval_loss": loss} for s, loss in pts], 2.5)
    assert t["steps_to_target"] == pytest.approx(15.0) and t["tokens_to_target"] == pytest.approx(15 * 8192)
    assert wan_metrics.trajectory_summary([{"step": 0, "tokens": 0, "eval_loss": 5.0}], 2.5)["steps_to_target"] is None


def test_merge_only_comparable_runs_and_keep_rates_sorted() -> None:
    p = wan_params.BenchParams(rates_mbit=(2.0,), merge=True)
    old_params = dataclasses.asdict(wan_params.BenchParams(merge=True))
    wan_params.merge_check(json.loads(json.dumps(old_params)), p)  # tuples come back from JSON as lists
    with pytest.raises(ValueError, match="max_time_s differs"):
        wan_params.merge_check({**old_params, "max_time_s": 60.0}, p)
    dp = {"median_step_s": 6.0, "tokens_per_s": 1.0, "time_to_target_s": 600.0, "wire_bytes_per_token": 400.0}
    ours = {"median_step_s": 1.5, "tokens_per_s": 4.0, "time_to_target_s": 200.0, "wire_bytes_per_token": 1.0}
    old = {"params": old_params, "started": "t0", "compute_only": {"median_step_s": 1.5},
           "rates": {"10": {"rate_mbit": 10.0, "methods": {"dp": dp}, "speedups": {}},
                     "200": {"rate_mbit": 200.0, "methods": {}, "speedups": {}}}}
    new = {"started": "t1", "rates": {"2": {"rate_mbit": 2.0, "methods": {}, "speedups": {}},
                                      "10": {"rate_mbit": 10.0, "methods": {"decoupled": ours}, "speedups": {}}}}
    merged = wan_metrics.merge_results(old, new)
    assert list(merged["rates"]) == ["2", "10", "200"]
    ten = merged["rates"]["10"]
    assert set(ten["methods"]) == {"dp", "decoupled"}  # a method measured later joins the rate's others
    assert ten["speedups"]["ideal_bound"] == pytest.approx(4.0)
    assert ten["speedups"]["decoupled"]["time_to_target"] == pytest.approx(3.0)
    assert ten["speedups"]["decoupled"]["share_of_bound"] == pytest.approx(0.75)
    assert ten["speedups"]["decoupled"]["fewer_wire_bytes_per_token"] == pytest.approx(400.0)
    assert merged["runs"] == ["t0", "t1"] and merged["compute_only"] == {"median_step_s": 1.5}


def test_blocking_diloco_needs_every_peer_and_no_overlap() -> None:
    sets = dict(s.split("=") for s in wan_params.method_overrides("blocking", 4))
    assert sets["outer.overlap"] == "0" and sets["outer.fragments"] == "1" and float(sets["outer.alpha"]) == 0.0
    assert sets["averaging.min_group_size"] == sets["averaging.target_group_size"] == "4"
    assert wan_params.method_overrides("decoupled", 4) == []
    with pytest.raises(ValueError):
        wan_params.method_overrides("dp", 4)


def _rank(rank: int, step_s: float) -> dict[str, Any]:
    return {"rank": rank, "median_step_s": step_s, "tokens": 20 * 8192, "steps": 20, "train_s": 20 * step_s,
            "final_eval_loss": 2.9, "curve": []}


TRAJECTORY = wan_metrics.trajectory_summary(
    [{"step": 0, "tokens": 0, "eval_loss": 5.3}, {"step": 100, "tokens": 100 * 8192, "eval_loss": 2.5},
     {"step": 200, "tokens": 200 * 8192, "eval_loss": 1.9}], target=2.2)


def test_dp_and_learner_metrics_and_speedups() -> None:
    dp = wan_metrics.dp_metrics([_rank(0, 5.0), _rank(1, 5.5), _rank(2, 5.0)], [1000, 2000, 3000],
                              compute_step_s=0.5, trajectory=TRAJECTORY)
    assert dp["median_step_s"] == 5.0 and dp["utilization"] == pytest.approx(0.1)
    assert TRAJECTORY["steps_to_target"] == pytest.approx(150.0)
    assert dp["time_to_target_s"] == pytest.approx(150 * 5.0) and dp["time_to_target_projected"]
    assert dp["wire_bytes_per_token"] == pytest.approx(6000 / (20 * 8192))
    finals = [{"tokens": 150 * 2048, "train_s": 500.0, "steps": 150, "eval_loss_end": 2.0, "utilization": 0.99,
               "committed": [3, 4], "discarded": [1, 0], "anchor_hashes": ["a", "b"], "bytes_sent": 10}
              for _ in range(4)]
    evals = [{"event": "eval", "train_s": 100.0, "eval_loss": 2.6}, {"event": "eval", "train_s": 200.0, "eval_loss": 2.0}]
    lr = wan_metrics.learner_metrics(finals, [10, 20, 30, 40], evals, TRAJECTORY)
    assert lr["tokens"] == 4 * 150 * 2048 and lr["median_step_s"] == pytest.approx(500 / 150)
    assert lr["time_to_target_s"] == pytest.approx(100 + 100 * 0.4 / 0.6)
    assert lr["dp_eval_loss_at_tokens"] == pytest.approx(2.2) and lr["vs_dp_at_tokens"] == pytest.approx(2.0 / 2.2 - 1)
    assert lr["anchors_identical"] and lr["committed"] == [7] * 4
    # no evaluation at or below the target, and none at the end either: unknown, not the run's length
    late = [{**f, "eval_loss_end": 2.4} for f in finals]
    assert wan_metrics.learner_metrics(late, [0] * 4, evals[:1], TRAJECTORY)["time_to_target_s"] is None
    sp = wan_metrics.speedups({"dp": dp, "decoupled": lr}, compute_step_s=0.5)
    assert sp["ideal_bound"] == pytest.approx(10.0)
    assert sp["decoupled"]["throughput"] == pytest.approx(lr["tokens_per_s"] / dp["tokens_per_s"])
    assert sp["decoupled"]["time_to_target"] == pytest.approx(750.0 / lr["time_to_target_s"])
    assert sp["decoupled"]["share_of_bound"] == pytest.approx(sp["decoupled"]["time_to_target"] / 10.0)
    assert wan_metrics.speedups({"decoupled": lr}, 0.5) == {}


def test_report_states_the_missing_latency_and_the_projection() -> None:
    dp = wan_metrics.dp_metrics([_rank(0, 5.0)], [1000], compute_step_s=0.5, trajectory=TRAJECTORY)
    result = {"params": {"hosts": 4, "config": "configs/demo.toml", "steps": 20, "max_time_s": 60.0,
                         "target_loss": 2.2, "eval_every_s": 15.0},
              "compute_only": {"median_step_s": 0.5}, "trajectory": TRAJECTORY,
              "rates": {"10": {"rate_mbit": 10.0, "methods": {"dp": dp}, "speedups": wan_metrics.speedups({"dp": dp}, 0.5)}}}
    md = wan_page.render_md(result)
    assert "no latency emulation" in md and "projected" in md
    assert "| 10 | dp | 5.000 | 0.16 | 750 (projected) |" in md


# ---------------------------------------------------------------- latency: relays in front of the services


def test_no_round_trip_means_no_relay_and_the_bridge_address_as_before() -> None:
    plan = netns.WanPlan(hosts=4, rate_mbit=10)
    assert not plan.relayed
    assert netns.listen_args(plan, 2, 31337) == ["--host", "10.77.0.3"]


def test_with_a_round_trip_peers_listen_on_loopback_and_announce_the_relay() -> None:
    plan = netns.WanPlan(hosts=4, rate_mbit=10, rtt_ms=100)
    assert plan.relayed
    assert netns.listen_args(plan, 2, 31337) == ["--host", "127.0.0.1", "--port", "31337",
                                                 "--announce", "/ip4/10.77.0.3/tcp/31337"]
    cmd = netns.relay_command(plan, 2, 31337, python="py")
    assert cmd[:2] == ["py", str(netns.RELAY)]
    assert cmd[cmd.index("--listen") + 1] == "10.77.0.3:31337"  # the address other hosts dial
    assert cmd[cmd.index("--target") + 1] == "127.0.0.1:31337"  # the service, behind it
    assert cmd[cmd.index("--delay-ms") + 1] == "50"  # one relay per connection: half the round trip each way
    sources = dict(cmd[k + 1].split("=") for k, a in enumerate(cmd) if a == "--source-delay-ms")
    assert sources == {"10.77.0.1": "50", "10.77.0.2": "50", "10.77.0.3": "0", "10.77.0.4": "50"}  # 0: same host


def test_a_ragged_host_is_slow_to_everyone_and_only_it() -> None:
    plan = netns.WanPlan(hosts=4, rate_mbit=10, rtt_ms=100, host_rtt_ms=netns.parse_host_rtts(["3=300"]))
    assert [netns.pair_rtt_ms(plan, 3, j) for j in range(4)] == [300, 300, 300, 0]
    assert [netns.pair_rtt_ms(plan, 0, j) for j in range(4)] == [0, 100, 100, 300]
    # whoever dials, the dialled relay holds each chunk for half the pair's round trip
    for i in range(4):
        cmd = netns.relay_command(plan, i, 31337)
        sources = dict(cmd[k + 1].split("=") for k, a in enumerate(cmd) if a == "--source-delay-ms")
        assert {src: float(ms) * 2 for src, ms in sources.items()} == {
            netns.host_address(plan, j): netns.pair_rtt_ms(plan, i, j) for j in range(4)}
    only_ragged = netns.WanPlan(hosts=4, rate_mbit=10, host_rtt_ms=((1, 200.0),))
    assert only_ragged.relayed and netns.pair_rtt_ms(only_ragged, 0, 2) == 0 and netns.pair_rtt_ms(only_ragged, 0, 1) == 200


def test_host_round_trips_parse_and_bad_ones_fail_with_one_line() -> None:
    assert netns.parse_host_rtts(["3=300,1=50", "2=0"]) == ((3, 300.0), (1, 50.0), (2, 0.0))
    assert netns.parse_host_rtts([]) == ()
    for bad in ("3", "x=5", "3=fast"):
        with pytest.raises(ValueError, match="expected HOST=MS"):
            netns.parse_host_rtts([bad])
    for kwargs, message in [({"rtt_ms": -1.0}, "rtt_ms must be"), ({"rtt_ms": float("nan")}, "rtt_ms must be"),
                            ({"host_rtt_ms": ((4, 10.0),)}, "host indices"),
                            ({"host_rtt_ms": ((1, 10.0), (1, 20.0))}, "host indices"),
                            ({"host_rtt_ms": ((1, 1e6),)}, "host_rtt_ms of host 1")]:
        with pytest.raises(ValueError, match=message):
            netns.WanPlan(hosts=4, rate_mbit=10, **kwargs)
    with pytest.raises(ValueError, match="relay port"):
        netns.relay_command(netns.WanPlan(hosts=2, rate_mbit=10, rtt_ms=10), 0, 0)


def test_check_flags_round_trips_far_from_the_requested_ones_only() -> None:
    pairs = [{"from": 1, "to": 0, "requested_ms": 100.0, "median_ms": 101.0},
             {"from": 2, "to": 0, "requested_ms": 300.0, "median_ms": 200.0},
             {"from": 3, "to": 0, "requested_ms": 0.0, "median_ms": 0.02}]
    assert netns.check_rtts({"rtt": pairs}) == ["host 2 -> host 0: 200.0 ms measured, 300 requested"]


def test_bench_with_latency_relays_the_learners_and_refuses_data_parallel() -> None:
    p = wan_params.BenchParams(methods=("blocking", "decoupled"), merge=True, rtt_ms=100, host_rtt_ms=((3, 300.0),))
    assert p.plan(10.0).relayed and netns.pair_rtt_ms(p.plan(10.0), 0, 3) == 300
    assert wan_params.relay_endpoints(3) == [(0, wan_params.BOOT_PORT), (0, wan_params.LEARNER_PORT),
                                            (1, wan_params.LEARNER_PORT), (2, wan_params.LEARNER_PORT)]
    with pytest.raises(ValueError, match="gloo"):
        wan_params.BenchParams(methods=("dp", "decoupled"), merge=True, rtt_ms=100)
    with pytest.raises(ValueError, match="host indices"):
        wan_params.BenchParams(methods=("decoupled",), merge=True, host_rtt_ms=((9, 300.0),))
    # results written before the round trip existed had none: they merge with a run without one, not with one
    old = {k: v for k, v in dataclasses.asdict(wan_params.BenchParams(merge=True)).items()
           if k not in ("rtt_ms", "host_rtt_ms")}
    wan_params.merge_check(old, wan_params.BenchParams(merge=True))
    with pytest.raises(ValueError, match="rtt_ms differs"):
        wan_params.merge_check(old, p)
    same = json.loads(json.dumps(dataclasses.asdict(p)))  # tuples of tuples come back as lists of lists
    wan_params.merge_check(same, p)
    text = wan_page.latency_text(dataclasses.asdict(p))
    assert "100 ms" in text and "host 3 at 300 ms" in text and "no latency" not in text
