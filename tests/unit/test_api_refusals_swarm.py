"""The public API's refusals of issue 49 around a joined swarm (no network): each bad call fails at once with one
clear line, before it touches shared state."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from p2p_diloco import Swarm, build_model
from p2p_diloco.core.config import Config
from test_engine import cfg, engine  # noqa: F401  (cfg: a fixture)


def test_start_after_close_is_a_clear_error(cfg: Config) -> None:  # noqa: F811
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        d.close()
        with pytest.raises(RuntimeError, match=r"^DiLoCo.start after finish\(\) or close\(\)"):
            d.start()
        assert not d.view._thread.is_alive()  # nothing was started


PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWG2rGRLwZHVBC2UGmDu2NUmW4JmQtR8jn7vaiURxKPUVK"


@pytest.mark.parametrize(("peers", "kwargs", "expected"), [
    ([PEER], {"config": 42}, "config: must be a Config, a TOML file's path, a bundled config's name, or None, got int 42"),
    ([PEER], {"swarm_key": 12345}, "swarm_key: must be bytes (the secret), the path of a key file, or None, got int"),
    ([PEER], {"identity": 7}, "identity: must be the path of a key file, or None, got int"),
    ([PEER], {"name": 5}, "name: must be a str, got int"),
    ([PEER], {"port": "31337"}, "port: must be an int"),
    ([PEER], {"port": True}, "port: must be an int (0: any free port), got bool"),
    ([PEER], {"join_timeout_s": "10"}, "join_timeout_s: must be a number of seconds, got str"),
    (42, {}, "initial_peers: must be multiaddrs (a list of str, or one str), got int"),
    ([PEER, 1], {}, "initial_peers: must be multiaddrs"),
    ([PEER], {"announce": b"/ip4/10.0.0.1/tcp/4000"}, "announce: must be multiaddrs"),
])
def test_swarm_join_refuses_a_wrong_type_with_a_type_error_naming_the_argument(
        cfg: Config, peers: Any, kwargs: dict[str, Any], expected: str) -> None:  # noqa: F811
    kwargs = {"config": cfg, **kwargs}
    with pytest.raises(TypeError) as e:
        Swarm.join(peers, **kwargs)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), e.value


def test_swarm_join_takes_any_iterable_of_multiaddrs(cfg: Config) -> None:  # noqa: F811
    """A generator of multiaddrs is read once: the type check does not use it up before its values are parsed."""
    with pytest.raises(ValueError, match="^initial_peers 'not': not a multiaddr"):
        Swarm.join((p for p in ["not an address"]), cfg, join_timeout_s=0)


@pytest.mark.parametrize("argument", ["name", "profile"])
def test_a_name_longer_than_a_record_holds_is_refused_at_once(cfg: Config, argument: str) -> None:  # noqa: F811
    """A 5,000-character name spent 23 s on warnings about our clock (every DHT node refused the record) before
    failing; now it fails in one line before anything starts."""
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        Swarm.join([PEER], cfg, **{argument: "x" * 5000})
    assert str(e.value) == f"{argument}: at most 64 characters (a peer record's limit), got 5,000"
    assert time.monotonic() - t0 < 5.0


def test_the_learner_cli_refuses_a_long_name_before_joining(refused: Callable[..., str]) -> None:
    from p2p_diloco.net.records import check_label

    check_label("name", "x" * 64)  # the longest a record holds
    refused(["join", "--initial-peers", PEER, "--config", "llama-tiny", "--name", "x" * 65],
            "--name: at most 64 characters (a peer record's limit), got 65")


@pytest.mark.parametrize("overrides", ["inner.lr=inf", None, [1], ("inner.lr=1e-3", b"outer.lr=0.5")])
def test_load_config_refuses_overrides_that_are_not_a_list_of_strings(overrides: Any) -> None:
    """A str was read one character at a time ("--set 'i': expected KEY=VALUE")."""
    from p2p_diloco import load_config

    with pytest.raises(TypeError) as e:
        load_config("llama-tiny", overrides)
    assert str(e.value).startswith('overrides: must be a list of "key=value" strings (e.g. ["inner.lr=3e-4"]), got ')
    assert "--set" not in str(e.value) and "\n" not in str(e.value)


def test_a_malformed_override_names_no_cli_flag_from_the_library_and_names_set_on_the_cli(
        capsys: pytest.CaptureFixture[str]) -> None:
    from p2p_diloco import load_config
    from p2p_diloco.cli import main as cli
    from p2p_diloco.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^override 'inner.lr': expected KEY=VALUE, e.g. outer.sync_every=50$"):
        load_config("llama-tiny", ["inner.lr"])
    assert load_config("llama-tiny", ("inner.lr=0.001",)).inner.lr == 0.001  # a tuple is a list of overrides too
    with pytest.raises(SystemExit) as e:
        cli.main(["config", "--config", "llama-tiny", "--set", "inner.lr"])
    assert e.value.code == 2
    assert "error: argument --set: override 'inner.lr': expected KEY=VALUE" in capsys.readouterr().err


def test_an_identity_in_a_missing_folder_is_refused_and_nothing_is_created(cfg: Config, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "no-such-folder" / "peer.key"
    with pytest.raises(ValueError) as e:
        Swarm.join([PEER], cfg, identity=path)
    assert str(e.value) == (f"identity {path}: folder {path.parent} does not exist (the key file is created if missing, "
                            "its folder is not)")
    assert not path.parent.exists()


def test_the_hf_callback_without_accelerate_fails_at_import_before_any_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """It failed in the Trainer's TrainingArguments, after the script had joined the swarm."""
    import importlib
    import sys

    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda *_a, **_kw: False)
    monkeypatch.delitem(sys.modules, "p2p_diloco.integrations.hf", raising=False)
    with pytest.raises(ImportError, match=r"^p2p_diloco.integrations.hf: transformers' Trainer needs accelerate>=\S+, "
                                          r"which is not installed: pip install 'p2p-diloco\[hf\]'$"):
        importlib.import_module("p2p_diloco.integrations.hf")
    monkeypatch.undo()
    assert importlib.import_module("p2p_diloco.integrations.hf").DiLoCoCallback  # with accelerate: imports
