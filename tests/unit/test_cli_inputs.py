"""Every bad input a person can give is refused before anything starts: one line naming the input,
exit code 2, no traceback, nothing left running (issue 17, items 5-7).

Most cases run ``cli.main`` in this process: the checks come before any DHT starts, which is the point,
and the ``refused`` fixture (``conftest.py``) asserts that no child process was left. The port already in use runs a real
``p2p-diloco bootstrap`` (the check must happen in the process that would start the daemon).
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from p2p_diloco.net import arguments, joined, membership
from p2p_diloco.cli import main as cli
from procs import UNREACHABLE_PEER as PEER
from procs import ProcGroup

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def _join(*extra: str) -> list[str]:
    """``join`` with a config file (without one, join would look the run's config up in the DHT first)."""
    return ["join", "--initial-peers", PEER, "--config", TINY, *extra]


# ---------------------------------------------------------------- item 6: checked before joining


def test_missing_empty_or_binary_data_path_is_refused_before_joining(tmp_path: Path, refused: Callable[..., str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_a: Any, **_k: Any) -> None:
        raise AssertionError("joined before checking the data")

    monkeypatch.setattr(joined, "joined_run", never)  # what Swarm.from_options calls
    missing = tmp_path / "missing.txt"
    refused(_join("--set", f"data.path={missing}"), f"data path {missing} does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    refused(_join("--set", f"data.path={empty}"), f"data path {empty} holds only 0 bytes")
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 400)
    refused(_join("--set", f"data.path={binary}"), f"data path {binary}: a binary file")


def test_swarm_key_folder_or_binary_file(tmp_path: Path, refused: Callable[..., str]) -> None:
    folder = tmp_path / "keys"
    folder.mkdir()
    refused(["status", "--initial-peers", PEER, "--swarm-key", str(folder)],
             f"--swarm-key {folder}: a folder, not a swarm key file")
    binary = tmp_path / "swarm.secret"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 8)
    binary.chmod(0o600)
    refused(["bootstrap", "--swarm-key", str(binary)], f"--swarm-key {binary}: not a swarm key (binary")


def test_identity_folder(tmp_path: Path, refused: Callable[..., str]) -> None:
    refused(["bootstrap", "--identity", str(tmp_path)], f"identity file {tmp_path}: a folder, not a key file")


@pytest.mark.parametrize("line, expected", [
    ('threads = "many"', "threads must be an integer, got 'many'"),
    ("slowdown = true", "slowdown must be a number, got True"),
    ("name = 3", "name must be a string, got 3"),
    ("slowdown = 0.5", "slowdown >= 1"),
])
def test_profile_with_a_bad_value(tmp_path: Path, refused: Callable[..., str], line: str, expected: str) -> None:
    profile = tmp_path / "fast.toml"
    profile.write_text(f'name = "fast"\n{line}\n' if not line.startswith("name") else f"{line}\n")
    refused(_join("--profile", str(profile)), f"{profile}: ", expected)


def test_profile_folder_or_binary(tmp_path: Path, refused: Callable[..., str]) -> None:
    refused(_join("--profile", str(tmp_path)), f"{tmp_path}: a folder, not a profile file")
    binary = tmp_path / "p.toml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    refused(_join("--profile", str(binary)), f"{binary}: not a text file")


def test_shard_options(refused: Callable[..., str]) -> None:
    refused(_join("--num-shards", "-2"), "--num-shards: must be >= 1, got -2")
    refused(_join("--shard", "1", "--num-shards", "0"), "--num-shards: must be >= 1, got 0")
    refused(_join("--num-shards", "3"), "--num-shards 3: only with --shard I")
    refused(_join("--shard", "3", "--num-shards", "3"), "--shard: must be in [0, 3) for 3 shards, got 3")
    refused(_join("--shard", "-1"), "--shard: must be >= 0, got -1")
    # the data layout is the learner's own: never sim.learners of the simulator
    refused(_join("--shard", "1"), "--shard 1: give --num-shards N too")
    refused(["join", "--initial-peers", PEER, "--shard", "0"], "--shard 0: give --num-shards N too")
    # without --config, join would first look the run's config up in the DHT: flags are checked before that
    refused(["join", "--initial-peers", PEER, "--num-shards", "-2"], "--num-shards: must be >= 1, got -2")
    refused(["join", "--initial-peers", PEER, "--steps", "0"], "--steps: must be >= 1, got 0")


def test_shard_count() -> None:
    from p2p_diloco.cli.learner import shard_count

    assert shard_count(None, None) == 1  # the whole training set
    assert shard_count(2, 3) == 3
    with pytest.raises(ValueError, match="--shard 2: give --num-shards N too"):
        shard_count(2, None)  # --shard alone: refused, whatever the config's sim.learners


# ---------------------------------------------------------------- item 7: accepted though meaningless


def test_empty_initial_peers(refused: Callable[..., str]) -> None:
    for command in ("join", "heartbeat", "status", "doctor"):
        refused([command, "--initial-peers", ""], "--initial-peers '': no address given")
    refused(["join", "--initial-peers", " , "], "--initial-peers ' , ': no address given")
    refused(["bootstrap", "--initial-peers", ""], "--initial-peers '': no address given")


def test_max_time_and_steps(refused: Callable[..., str]) -> None:
    refused(_join("--max-time", "-1"), "--max-time: must be > 0 seconds, got -1")
    refused(_join("--max-time", "0"), "--max-time: must be > 0 seconds, got 0")
    refused(_join("--steps", "0"), "--steps: must be >= 1, got 0")
    refused(_join("--steps", "-5"), "--steps: must be >= 1, got -5")
    refused(_join("--linger", "-1"), "--linger: must be >= 0, got -1")
    refused(_join("--final-wait", "-1"), "--final-wait: must be >= 0, got -1")
    refused(_join("--lr-tokens", "0"), "--lr-tokens: must be >= 1 tokens, got 0")


def test_status_watch_interval(refused: Callable[..., str]) -> None:
    refused(["status", "--initial-peers", PEER, "--watch", "--interval", "0"],
             "--interval 0: must be at least 0.5 s")
    refused(["status", "--initial-peers", PEER, "--watch", "--interval", "-3"], "--interval -3: ")


def test_keygen_into_a_missing_folder(tmp_path: Path, refused: Callable[..., str]) -> None:
    target = tmp_path / "nonexistent" / "dir" / "x"
    refused(["keygen", "--out", str(target)],
             f"--out {target}: folder {target.parent} does not exist")
    refused(["keygen", "--identity", str(target)],
             f"--identity {target}: folder {target.parent} does not exist")
    assert not (tmp_path / "nonexistent").exists()


# ---------------------------------------------------------------- item 5: a port already in use


def test_port_in_use_is_refused_in_process(refused: Callable[..., str], held_port: socket.socket) -> None:
    port = held_port.getsockname()[1]
    expected = (f"--port {port}: 127.0.0.1:{port} is already in use (another peer?); "
                "pick another port or 0 for any free port")
    for argv in (["heartbeat", "--initial-peers", PEER, "--port", str(port)], _join("--port", str(port))):
        line = refused(argv)
        assert line == f"p2p-diloco: error: {expected}", line


def test_port_in_use_is_refused_by_bootstrap(tmp_path: Path, held_port: socket.socket, procs: ProcGroup) -> None:
    port = held_port.getsockname()[1]
    rc, proc, _ = procs.run("bootstrap", "--port", str(port), "--identity", str(tmp_path / "boot.id"), timeout_s=120)
    out = "\n".join(line for _, line in proc.stdout)
    err = "\n".join(line for _, line in proc.stderr)
    assert rc == 2, proc.output()
    assert err.strip() == (f"p2p-diloco: error: --port {port}: 127.0.0.1:{port} is already in use "
                           "(another peer?); pick another port or 0 for any free port"), err
    assert "ready" not in out and "Traceback" not in err
    assert not (tmp_path / "boot.id").exists()  # refused before anything was created


def test_a_free_fixed_port_or_a_port_in_time_wait_passes(held_port: socket.socket, free_port: int) -> None:
    from p2p_diloco.net.addresses import check_port_free

    port = held_port.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = held_port.accept()
    conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
    client.close()
    held_port.close()
    check_port_free("127.0.0.1", port)  # a peer restarted on its port right away is not refused
    check_port_free("127.0.0.1", free_port)


# ---------------------------------------------------------------- a peer that fails after joining


class _Publisher:
    def __init__(self, events: list[str], ok: bool = True, error: Exception | None = None) -> None:
        self.events, self.ok, self.error = events, ok, error

    def leave(self) -> bool:
        self.events.append("leave")
        if self.error is not None:
            raise self.error
        return self.ok


def test_leave_on_failure_publishes_the_tombstone_and_reraises(capsys: pytest.CaptureFixture[str]) -> None:
    from p2p_diloco.net.joined import leave_on_failure

    events: list[str] = []
    with pytest.raises(ValueError, match="averagers did not start"):
        with leave_on_failure(_Publisher(events)):
            raise ValueError("averagers did not start")
    assert events == ["leave"]
    assert "leaving after an error (ValueError); tombstone published" in capsys.readouterr().out

    with leave_on_failure(_Publisher(events)):  # no error: the caller leaves itself
        pass
    assert events == ["leave"]

    # a failing leave is logged; the original error is the one that propagates
    with pytest.raises(KeyError):
        with leave_on_failure(_Publisher(events, error=RuntimeError("DHT gone"))):
            raise KeyError("x")
    assert events == ["leave", "leave"]


def test_joined_run_leaves_before_the_dht_stops(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The wiring: an error in the body of ``joined_run`` (e.g. in ``Learner(...)``) publishes the tombstone
    while the DHT still runs, then the DHT stops; the ``listening:`` lines are printed when joining."""
    from p2p_diloco.core.config import load_config
    from p2p_diloco.net.records import LocalRun

    events: list[str] = []

    class FakeDHT:
        alive = True
        peer_id = SimpleNamespace(to_base58=lambda: "QmFakePeer")

        def is_alive(self) -> bool:
            return self.alive

        def shutdown(self) -> None:
            events.append("dht shutdown")
            self.alive = False

        def join(self, timeout: float | None = None) -> None:
            pass

    class FakePublisher(_Publisher):
        period_s = 1.0

        def __init__(self, *_a: Any, **_k: Any) -> None:
            super().__init__(events)

        def publish_within(self, deadline_s: float) -> bool:
            events.append("published")
            return True

    monkeypatch.setattr(membership, "start_dht", lambda *a, **k: FakeDHT())
    monkeypatch.setattr(membership, "read_swarm", lambda *a, **k: SimpleNamespace(views=[], live=lambda: [], now=0.0))
    monkeypatch.setattr(membership, "visible_addresses", lambda dht: ["/ip4/127.0.0.1/tcp/4242/p2p/QmFakePeer"])
    monkeypatch.setattr(membership, "RecordPublisher", FakePublisher)
    args = cli.build_parser().parse_args(["heartbeat", "--initial-peers", PEER])
    local = LocalRun.from_config(load_config())
    with pytest.raises(RuntimeError, match="learner failed"):
        with joined.joined_run(arguments.swarm_options(args, client_mode=False), args.name, local, 2, ttl_s=30.0):
            events.append("body")
            raise RuntimeError("learner failed")
    assert events == ["published", "body", "leave", "dht shutdown"], events
    out = capsys.readouterr().out
    assert "listening: /ip4/127.0.0.1/tcp/4242/p2p/QmFakePeer" in out
    assert "leaving after an error (RuntimeError); tombstone published" in out


def test_output_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """``p2p-diloco config | head -1``: the reader leaves before we are done; no BrokenPipeError traceback. The
    reader here is ``true``, which leaves before a Python process has started, so every write meets a closed pipe."""
    import subprocess

    from p2p_diloco.local.launcher import cli_argv

    command = " ".join(cli_argv("config", "--config", "demo")) + " | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode in (0, 141), (done.returncode, done.stderr)


@pytest.mark.parametrize(("flags", "expected"), [
    (("--checkpoint-dir", "/proc/nope"), "--checkpoint-dir /proc/nope: cannot write there"),
    (("--events", "/proc/x.jsonl"), "--events /proc/x.jsonl: cannot write it"),
    (("--metrics", "jsonl:/proc/nope/x.jsonl"), "--metrics jsonl: /proc/nope/x.jsonl: cannot write it"),
    (("--metrics", "tensorboard:/proc/tb"), "--metrics tensorboard: /proc/tb: cannot write there"),
], ids=["checkpoint-dir", "events", "metrics-jsonl", "metrics-tensorboard"])
def test_paths_we_cannot_write_are_refused_before_joining(refused: Callable[..., str], flags: tuple[str, ...],
                                                         expected: str) -> None:
    # the initial peer is unreachable: a refusal that came after joining would be a different error
    print(refused(_join(*flags), expected))


def test_config_help_names_the_bundled_configs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bootstrap", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "or the name of a bundled one (" in shown and "demo" in shown and "tiny" in shown, shown
