"""Real processes on 127.0.0.1: peers with the same files under different paths join one run; a peer with
other files is refused before joining, with one line naming both dataset fingerprints.

The run's config is ``configs/tiny.toml`` with ``data.source = "files"``; each peer points ``data.path`` at
its own folder. The config hash covers the files' fingerprint, never the path. Times are printed (``-s``),
never asserted.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "p2p-diloco-tests-hf-home"))  # not ~/.cache

import pytest

from procs import ProcGroup, start_bootstrap, start_member

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


def test_same_files_elsewhere_join_and_other_files_are_refused(tmp_path: Path, make_corpus: Callable[..., Path]) -> None:
    from p2p_diloco.core import datasource
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash

    ours = make_corpus(tmp_path / "alice" / "corpus", n=16)
    same = shutil.copytree(ours, tmp_path / "bob" / "somewhere" / "else")
    other = make_corpus(tmp_path / "carol" / "corpus", n=16, first=900)

    def args(path: Path) -> list[str]:
        return ["--config", TINY, "--set", 'data.source="files"', "--set", f'data.path="{path}"']

    run_hash = config_hash(load_config(TINY, args(ours)[3::2]))
    theirs = datasource.fingerprint(load_config(TINY, args(ours)[3::2]).data).digest
    mine = datasource.fingerprint(load_config(TINY, args(other)[3::2]).data).digest
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, *args(ours))
        alice = start_member(procs, peers, "alice", *args(ours))
        alice.wait_for(rf"^joined run tiny as alice \(\w+\); config hash {run_hash}; ")
        bob = start_member(procs, peers, "bob", *args(same))
        bob.wait_for(rf"^joined run tiny as bob \(\w+\); config hash {run_hash}; 1 other live peers")

        rc, carol, wall_s = procs.run("heartbeat", "--initial-peers", peers, "--name", "carol", *args(other))
        assert rc == 2, carol.output()
        errors = [line for _, line in carol.stderr if line.startswith("p2p-diloco:")]
        assert len(errors) == 1, carol.output()
        assert re.fullmatch(rf"p2p-diloco: error: refused by run 'tiny': data fingerprint differs: yours {mine} "
                            rf"\(path {re.escape(str(other))}, 4 files, \d+ kB\), the run's {theirs}; every peer "
                            rf"needs the same files", errors[0]), errors[0]
        assert not any(line.startswith("joined run") for _, line in carol.stdout), carol.output()
        print(f"\nrefused after {wall_s:.1f} s: {errors[0]}")
