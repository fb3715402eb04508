"""The ``p2p-diloco`` command line.

Only the standard library and :mod:`p2p_diloco.core.config` are imported at module level, so
``p2p-diloco --help`` answers fast; each subcommand imports torch / hivemind when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from p2p_diloco.core.version import VERSION as __version__
from p2p_diloco.core.config import ConfigError, load_config, override_arg, render
from p2p_diloco.core.identity import config_hash
from p2p_diloco.hivemind_ext.lazyimports import defer_unused_imports

Handler = Callable[[argparse.Namespace], int]


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run config (TOML): a file, or a bundled config by name from any "
                   "directory (configs/demo.toml, demo, tiny, ...); default: built-in defaults")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[], type=override_arg,
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
    from p2p_diloco.core.devices import check_precision, machine_device

    device = machine_device(args.device)  # --device cuda on a machine without one: one line, nothing run
    cfg = load_config(args.config, args.overrides)
    check_precision(cfg.inner.precision, device)
    from p2p_diloco.core.model import check_buildable

    check_buildable(cfg.model, device, cfg.sim.learners if args.mode == "diloco" else 1, "sim.learners")
    from p2p_diloco.core.tokenizer import loss_unit
    from p2p_diloco.sim import simulator as sim
    if args.mode == "diloco" and not args.tick:
        from p2p_diloco.core import data
        from p2p_diloco.sim import engines

        engines.check_supported(cfg)
        splits = data.load_training_data(cfg, cfg.sim.learners, args.data)
        result = engines.run(cfg, splits, progress=not args.quiet, device=device)
    else:
        result = sim.run_from_config(cfg, mode=args.mode, data_path=args.data, progress=not args.quiet, device=device)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    saved = summary["bytes_saved_vs_dp_fp32"]
    print(f"mode {summary['mode']}: {summary['learners']} learner(s), {summary['tokens']:,} tokens, "
          f"{summary['wall_s']:.0f} s")
    print(f"held-out eval loss: {summary['final_eval_loss']:.4f} {loss_unit(cfg)} "
          f"(untrained {result.curve[0]['eval_loss']:.2f})")
    if args.mode == "diloco":
        print(f"rounds: {summary['rounds']} ({summary['empty_rounds']} with nobody due); "
              f"bytes sent {summary['bytes_sent'] / 1e6:.2f} MB = {saved:.0f}x fewer than fp32 data-parallel")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.tools import export

    config = load_config(args.config, args.overrides) if args.config or args.overrides else None
    label = f"--config {args.config}" if args.config else "--set"
    done = export.export(Path(args.checkpoint), Path(args.out), config=config, config_label=label, force=args.force)
    if args.json:
        print(json.dumps({"out": str(done.out), "files": list(done.files), **done.info}, indent=2))
        return 0
    info = done.info
    print(f"exported the global model of {info['checkpoint']} (step {info['step']}, run {info['run_id']}, "
          f"anchors {' '.join(info['anchor_hashes'] or [])}) to {done.out}")
    print(f"{info['model']}, {info['parameters']:,} parameters; tokenizer: {info['tokenizer']}")
    print(f"files: {', '.join(done.files)}")
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
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=cmd_config)

    from p2p_diloco.cli import learner as learner_cli

    p = sub.add_parser("sim", help="simulate K learners in one process (real engines on an in-process network) and "
                                   "report eval loss")
    add_config_args(p)
    p.add_argument("--mode", default="diloco", choices=["diloco", "data-parallel", "single"],
                   help="diloco: the configured algorithm; data-parallel: the reference with K x batch; "
                   "single: one learner alone")
    p.add_argument("--tick", action="store_true",
                   help="diloco mode on the tick simulator (a fragment state machine per learner and one reducer) "
                   "instead of K real DiLoCo engines on an in-process network; it also runs outer.error_feedback, "
                   "outer.final_average and grid groups")
    p.add_argument("--data", metavar="PATH", help="text file or folder (overrides data.path)")
    learner_cli.add_device_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the full result (with the eval-loss curve) as JSON")
    p.set_defaults(handler=cmd_sim)

    from p2p_diloco.cli import local, members  # stdlib-only at import: --help stays fast

    members.add_parsers(sub)
    learner_cli.add_parsers(sub)
    local.add_parsers(sub)

    export_help = ("write the global model (the anchors) of a learner checkpoint as a Hugging Face folder "
                   "(model.kind = \"hf\": AutoModelForCausalLM.from_pretrained loads it) or, for the byte GPT, "
                   "model.safetensors + config.json (p2p_diloco.tools.export.load_byte_gpt loads it)")
    p = sub.add_parser("export", help=export_help, description=export_help)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a --checkpoint-dir (its newest checkpoint that verifies) or one ckpt-* folder")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write; must be new or empty unless --force")
    add_config_args(p)
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out, replacing files of the same names")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.epilog = ("The model is rebuilt from the config the checkpoint records; --config (with --set) is needed only "
                "for checkpoints that predate that, and must then have the checkpoint's config hash. When given "
                "otherwise, it must describe the same model.")
    p.set_defaults(handler=cmd_export)
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
    except BrokenPipeError:  # `status | head`: the reader left; say nothing, as other Unix tools do
        quiet_broken_pipe()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError) as e:
        print(f"p2p-diloco: error: {e}", file=sys.stderr)
        return 2


def quiet_broken_pipe() -> None:
    """Point stdout at /dev/null so that the interpreter's own flush at exit does not raise again on the closed
    pipe (Python's documented recipe for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
