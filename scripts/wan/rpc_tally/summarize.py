#!/usr/bin/env python3
"""Add up the per-process tallies of ``sitecustomize.py`` (see there) by DHT key and by what they are for.

    python scripts/wan/rpc_tally/summarize.py TALLY_DIR                        # the table, by key
    python scripts/wan/rpc_tally/summarize.py --label before DIR1 --label after DIR2 --out results/wan-bytes
        # by purpose, side by side: bytes.json, README.md (the page), bytes.png
    python scripts/wan/rpc_tally/summarize.py --render-only --out results/wan-bytes   # the page again, from bytes.json

The page is written by ``scripts/_bench.py`` (through the shim ``_bench.py`` here), imported where it is needed:
this module is also loaded on its own, by file, with nothing of ``scripts/`` on ``sys.path``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

PAYLOAD_STREAMS = ("stream_send", "stream_send AveragingData", "stream_send DownloadRequest", "stream_send DownloadData")
"""Stream messages that carry tensors: all-reduce parts and state downloads (plain ``stream_send``: tallies from
before stream messages were named by type, when all of them were counted here)."""
MATCHMAKING_STREAMS = ("stream_send JoinRequest", "stream_send MessageFromLeader")
"""hivemind's matchmaking: join requests and the leader's answers (with every member's gathered metadata)."""
PURPOSES = (
    ("pseudo-gradients and state downloads", lambda n: n in PAYLOAD_STREAMS),
    ("swarm reads (peer records)", lambda n: n.startswith(("call:rpc_find get p2p-diloco.run.",
                                                            "call:rpc_values get p2p-diloco.run."))),
    ("sync clock reads", lambda n: "sync_clock" in n),
    ("our record published", lambda n: n.split(" ", 1)[-1].startswith("store p2p-diloco.run.")),
    ("run index entry published", lambda n: n.split(" ", 1)[-1].startswith("store p2p-diloco_runs")),
    ("commit verdicts", lambda n: "_commit_" in n),
    ("state-sharing declarations", lambda n: "all_averagers" in n),
    ("matchmaking (hivemind)", lambda n: "_frag" in n or n in MATCHMAKING_STREAMS),
    ("group offers, decisions and verdicts", lambda n: n.startswith(("call:rpc_group_offer", "call:rpc_group_decision",
                                                                     "call:rpc_group_verdict"))),
)
OTHER = "other (start barrier, pings, status)"
"""(``call:rpc_values`` is p2p_diloco's read of a key's values from the nodes that hold it, without a search.)"""
METHOD = """\
`scripts/wan/rpc_tally/` is a measuring tool: with its folder on `PYTHONPATH` and `RPC_TALLY_OUT` set, every process
of a run (learners and their forked DHT and averager processes) tallies the bytes of each hivemind RPC -- requests
and answers, all-reduce parts and state downloads -- by the DHT key it serves (`sitecustomize.py`), and
`summarize.py` adds them up by purpose. The runs compared here are `scripts/wan/bench_wan.py` runs of 4 learners at
200 Mbit/s for 90 s of training (`--rates 200 --methods decoupled --max-time 90`), each labelled with the code it ran;
their interfaces' `tx_bytes` are in the `run-*.json` files beside this page. The bytes counted are what the RPCs carry,
not the libp2p and TCP framing (about 1 KB per call)."""
"""The page's method section (``results/wan-bytes/README.md``)."""


def summarize(folder: Path) -> dict[str, list[int]]:
    """``{name: [calls, bytes sent, bytes received]}`` over every ``<pid>.json`` in ``folder``."""
    total: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"{folder}: no tallies (was RPC_TALLY_OUT set and PYTHONPATH on the rpc_tally folder?)")
    for f in files:
        for name, (calls, sent, received) in json.loads(f.read_text())["counts"].items():
            t = total[name]
            t[0] += calls
            t[1] += sent
            t[2] += received
    return dict(sorted(total.items(), key=lambda kv: -(kv[1][1] + kv[1][2])))


def by_purpose(total: dict[str, list[int]]) -> dict[str, dict[str, int]]:
    """Calls and bytes (sent + received, so each byte on the wire once) per purpose, in :data:`PURPOSES` order."""
    out: dict[str, dict[str, int]] = {p: {"calls": 0, "bytes": 0} for p, _ in PURPOSES}
    out[OTHER] = {"calls": 0, "bytes": 0}
    for name, (calls, sent, received) in total.items():
        purpose = next((p for p, match in PURPOSES if match(name)), OTHER)
        out[purpose]["calls"] += calls
        out[purpose]["bytes"] += sent + received
    return out


def compare(runs: list[tuple[str, Path]], out: Path) -> dict[str, Any]:
    """The folders by purpose, side by side: ``bytes.json``, the page and the figure in ``out``; returns what was
    written."""
    result: dict[str, Any] = {"runs": {}}
    for label, folder in runs:
        purposes = by_purpose(summarize(folder))
        result["runs"][label] = {"folder": str(folder), "purposes": purposes,
                                 "total_bytes": sum(p["bytes"] for p in purposes.values()),
                                 "total_calls": sum(p["calls"] for p in purposes.values())}
    import _bench

    return _bench.publish(_page(), out, result, markdown, plot, indent=1, echo=False)


def _page() -> Any:
    import _bench

    return _bench.Bench("bytes", "wan-bytes", "Where the bytes go: hivemind RPCs by purpose",
                        "scripts/wan/rpc_tally/summarize.py", METHOD)


def _purposes_in(result: dict[str, Any]) -> list[str]:
    """:data:`PURPOSES` and :data:`OTHER` that some run of ``result`` counts (a JSON from before a purpose was
    split out renders as it did)."""
    return [p for p in [p for p, _ in PURPOSES] + [OTHER] if any(p in r["purposes"] for r in result["runs"].values())]


def markdown(result: dict[str, Any]) -> str:
    """Megabytes and calls per purpose, one pair of columns per run."""
    labels = list(result["runs"])
    purposes_all = _purposes_in(result)
    lines = ["| purpose | " + " | ".join(f"{lb}: MB | {lb}: calls" for lb in labels) + " |",
             "|---|" + "---|---|" * len(labels)]
    for purpose in purposes_all:
        cells = []
        for lb in labels:
            r = result["runs"][lb]
            p = r["purposes"].get(purpose, {"bytes": 0, "calls": 0})
            cells.append(f"{p['bytes'] / 1e6:.2f} ({100 * p['bytes'] / max(1, r['total_bytes']):.0f}%) | {p['calls']}")
        lines.append(f"| {purpose} | " + " | ".join(cells) + " |")
    lines.append("| **counted, all** | " + " | ".join(
        f"{result['runs'][lb]['total_bytes'] / 1e6:.2f} | {result['runs'][lb]['total_calls']}" for lb in labels) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Stacked bars: each run's megabytes by purpose."""
    import _bench

    labels = list(result["runs"])
    with _bench.figure(path, 1, (10, 4.5)) as (ax,):
        bottoms = [0.0] * len(labels)
        for purpose in _purposes_in(result):
            heights = [result["runs"][lb]["purposes"].get(purpose, {"bytes": 0})["bytes"] / 1e6 for lb in labels]
            ax.bar(labels, heights, bottom=bottoms, label=purpose)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("MB counted (all hosts)")
        ax.set_title("What a 4-learner swarm sends, by purpose")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", type=Path, nargs="*")
    ap.add_argument("--label", action="append", default=[], help="one per folder, for --out")
    ap.add_argument("--out", type=Path, help="write bytes.json, README.md and bytes.png: the folders by purpose, side by side")
    ap.add_argument("--render-only", action="store_true", help="rewrite --out/README.md from --out/bytes.json")
    args = ap.parse_intermixed_args(argv)
    try:
        if args.render_only:
            if not args.out:
                raise ValueError("--render-only needs --out")
            page = _page()
            page.write_page(args.out, markdown(page.load(args.out)))
            return 0
        if not args.folders:
            raise ValueError("give at least one tally folder")
        if args.out:
            if len(args.label) != len(args.folders):
                raise ValueError(f"--label: one per folder ({len(args.folders)}), got {len(args.label)}")
            print(markdown(compare(list(zip(args.label, args.folders)), args.out)), end="")
            return 0
        for folder in args.folders:
            total = summarize(folder)
            all_bytes = sum(s + r for _, s, r in total.values()) or 1
            for name, (calls, sent, received) in total.items():
                print(f"{name[:80]:80s} {calls:7d} calls {(sent + received) / 1e6:7.2f} MB "
                      f"{100 * (sent + received) / all_bytes:5.1f}%")
            print(f"{'total':80s} {sum(c for c, _, _ in total.values()):7d} calls {all_bytes / 1e6:7.2f} MB")
    except ValueError as e:
        print(f"summarize: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
