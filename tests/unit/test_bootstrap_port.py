"""A bootstrap restarted with the same identity keeps its whole address, peer id and port (the port is kept in
``<identity>.port``), unless the port is taken meanwhile: then a WARNING and a new port."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from p2p_diloco.net.membership import SwarmOptions
from p2p_diloco.net.keptport import port_file, remember_port, remembered_port, with_kept_port


def _opts(identity_path: Path) -> SwarmOptions:
    from p2p_diloco.net.keys import Identity

    return SwarmOptions(identity=Identity(identity_path, "QmX", "ed25519", b"\0" * 32))


def test_the_port_file_beside_the_identity(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ident = tmp_path / "boot.id"
    assert port_file(ident) == tmp_path / "boot.id.port" and remembered_port(ident) == 0
    remember_port(ident, "/ip4/127.0.0.1/tcp/41234/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp")
    assert port_file(ident).read_text() == "41234\n" and remembered_port(ident) == 41234
    assert [p.name for p in tmp_path.iterdir()] == ["boot.id.port"]  # no temporary file left
    port_file(ident).write_text("garbage\n")
    with caplog.at_level(logging.WARNING):
        assert remembered_port(ident) == 0
    assert "holds no port" in caplog.text


def test_a_taken_kept_port_falls_back_to_a_new_one_with_a_warning(tmp_path: Path, held_port: socket.socket,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    ident = tmp_path / "boot.id"
    opts = _opts(ident)
    assert with_kept_port(opts) is opts  # first start: nothing kept, any free port
    taken = held_port.getsockname()[1]
    port_file(ident).write_text(f"{taken}\n")
    with caplog.at_level(logging.WARNING):
        assert with_kept_port(opts).port == 0
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"cannot listen again on port {taken}" in warning.getMessage() and "already in use" in warning.getMessage()
    held_port.close()
    assert with_kept_port(opts).port == taken  # free again: kept
