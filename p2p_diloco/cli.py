"""The ``p2p-diloco`` command line.

Only the standard library and :mod:`p2p_diloco.config` are imported at module level, so
``p2p-diloco --help`` answers fast; each subcommand imports torch / hivemind when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from p2p_diloco import __version__
from p2p_diloco.config import ConfigError, config_hash, load_config, render
from p2p_diloco.lazyimports import defer_unused_imports

Handler = Callable[[argparse.Namespace], int]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run config (TOML), e.g. configs/demo.toml; default: built-in defaults")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config value, e.g. --set outer.sync_every=50 (repeatable)")


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "config_hash": config_hash(cfg)}, indent=2))
    else:
        print(render(cfg), end="")
        print(f"# config_hash = {config_hash(cfg)}")
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from p2p_diloco import sim  # heavy: torch

    cfg = load_config(args.config, args.overrides)
    result = sim.run_from_config(cfg, mode=args.mode, data_path=args.data, progress=not args.quiet)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    saved = summary["bytes_saved_vs_dp_fp32"]
    print(f"mode {summary['mode']}: {summary['learners']} learner(s), {summary['tokens']:,} tokens, "
          f"{summary['wall_s']:.0f} s")
    print(f"held-out eval loss: {summary['final_eval_loss']:.4f} nats/byte "
          f"(untrained {result.curve[0]['eval_loss']:.2f})")
    if args.mode == "diloco":
        print(f"rounds: {summary['rounds']} ({summary['empty_rounds']} with nobody due); "
              f"bytes sent {summary['bytes_sent'] / 1e6:.2f} MB = {saved:.0f}x fewer than fp32 data-parallel")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2p-diloco",
        description="Peer-to-peer Decoupled DiLoCo: train a language model across machines that are far apart, "
        "slow, unreliable and unequal, with no central server.",
    )
    parser.add_argument("--version", action="version", version=f"p2p-diloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved config and its hash")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=cmd_config)

    p = sub.add_parser("sim", help="simulate K learners in one process (no network) and report eval loss")
    _add_config_args(p)
    p.add_argument("--mode", default="diloco", choices=["diloco", "data-parallel", "single"],
                   help="diloco: the configured algorithm; data-parallel: the reference with K x batch; "
                   "single: one learner alone")
    p.add_argument("--data", metavar="PATH", help="text file or folder (overrides data.path)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the full result (with the eval-loss curve) as JSON")
    p.set_defaults(handler=cmd_sim)

    from p2p_diloco import swarm_cli  # stdlib-only at import: --help stays fast

    swarm_cli.add_parsers(sub)
    from p2p_diloco import learner_cli  # stdlib-only at import, like swarm_cli
    learner_cli.add_parsers(sub)
    from p2p_diloco import swarm_run  # stdlib-only at import, like swarm_cli
    swarm_run.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    defer_unused_imports()  # before any command imports hivemind: scipy.optimize loads only if ever used
    try:
        return handler(args)
    except ConfigError as e:
        print(f"p2p-diloco: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("p2p-diloco: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError) as e:
        print(f"p2p-diloco: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
