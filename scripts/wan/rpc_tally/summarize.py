#!/usr/bin/env python3
"""Add up the per-process tallies of ``sitecustomize.py`` (see there) by DHT key and by what they are for.

    python scripts/wan/rpc_tally/summarize.py TALLY_DIR                        # the table, by key
    python scripts/wan/rpc_tally/summarize.py --label before DIR1 --label after DIR2 --out results/wan-bytes
        # by purpose, side by side: bytes.json, bytes.md, bytes.png
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

PURPOSES = (
    ("pseudo-gradients and state downloads", lambda n: n == "stream_send"),
    ("swarm reads (peer records)", lambda n: n.startswith("call:rpc_find get p2p-diloco.run.")),
    ("sync clock reads", lambda n: "sync_clock" in n),
    ("our record published", lambda n: n.split(" ", 1)[-1].startswith("store p2p-diloco.run.")),
    ("run index entry published", lambda n: n.split(" ", 1)[-1].startswith("store p2p-diloco_runs")),
    ("commit verdicts", lambda n: "_commit_" in n),
    ("state-sharing declarations", lambda n: "all_averagers" in n),
    ("matchmaking (hivemind)", lambda n: "_frag" in n),
)
OTHER = "other (start barrier, pings, status)"


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
    result: dict[str, Any] = {"runs": {}}
    for label, folder in runs:
        purposes = by_purpose(summarize(folder))
        result["runs"][label] = {"folder": str(folder), "purposes": purposes,
                                 "total_bytes": sum(p["bytes"] for p in purposes.values()),
                                 "total_calls": sum(p["calls"] for p in purposes.values())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bytes.json").write_text(json.dumps(result, indent=1))
    labels = [label for label, _ in runs]
    purposes_all = [p for p, _ in PURPOSES] + [OTHER]
    lines = ["| purpose | " + " | ".join(f"{lb}: MB | {lb}: calls" for lb in labels) + " |",
             "|---|" + "---|---|" * len(labels)]
    for purpose in purposes_all:
        cells = []
        for lb in labels:
            r = result["runs"][lb]
            p = r["purposes"][purpose]
            cells.append(f"{p['bytes'] / 1e6:.2f} ({100 * p['bytes'] / max(1, r['total_bytes']):.0f}%) | {p['calls']}")
        lines.append(f"| {purpose} | " + " | ".join(cells) + " |")
    lines.append("| **counted, all** | " + " | ".join(
        f"{result['runs'][lb]['total_bytes'] / 1e6:.2f} | {result['runs'][lb]['total_calls']}" for lb in labels) + " |")
    (out / "bytes.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottoms = [0.0] * len(labels)
    for purpose in purposes_all:
        heights = [result["runs"][lb]["purposes"][purpose]["bytes"] / 1e6 for lb in labels]
        ax.bar(labels, heights, bottom=bottoms, label=purpose)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("MB counted (all hosts)")
    ax.set_title("What a 4-learner swarm sends, by purpose")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(out / "bytes.png", dpi=110)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", type=Path, nargs="+")
    ap.add_argument("--label", action="append", default=[], help="one per folder, for --out")
    ap.add_argument("--out", type=Path, help="write bytes.{json,md,png}: the folders by purpose, side by side")
    args = ap.parse_intermixed_args(argv)
    try:
        if args.out:
            if len(args.label) != len(args.folders):
                raise ValueError(f"--label: one per folder ({len(args.folders)}), got {len(args.label)}")
            compare(list(zip(args.label, args.folders)), args.out)
            print((args.out / "bytes.md").read_text(), end="")
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
