"""The README's library snippet ("Your own training loop") runs as written: cut from README.md, its placeholder
address replaced by a real bootstrap's; it trains its 100 steps, leaves the swarm and exits 0. (Alone: its rounds
find no group, which the engine shrugs off; rounds with peers are ``test_api_examples.py``'s.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from procs import ProcGroup, start_bootstrap

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER = "/ip4/127.0.0.1/tcp/PORT/p2p/Qm..."
DEADLINE_S = 240.0
"""Start to exit, generous: 100 steps, the final rounds and the linger on a shared machine."""


def readme_snippet() -> str:
    """The first ``python`` block after the README's "Your own training loop" heading."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own training loop"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README: no python block under 'Your own training loop'"
    return match.group(1)


def test_the_readmes_snippet_runs_as_written(tmp_path: Path) -> None:
    snippet = readme_snippet()
    assert snippet.count(PLACEHOLDER) == 1, "the snippet's address placeholder changed: update this test"
    config = REPO / "configs" / "llama-tiny.toml"
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", str(config))
        script = tmp_path / "snippet.py"
        script.write_text(snippet.replace(PLACEHOLDER, peers)
                          + 'print("snippet done", diloco.versions, diloco.anchor_hashes, flush=True)\n')
        snippet_proc = procs.start([sys.executable, str(script)], name="snippet")
        snippet_proc.wait_for(r"^snippet done \[0(, 0)*\] \[", timeout_s=DEADLINE_S)
        assert snippet_proc.wait_exit(60) == 0, snippet_proc.output()
    assert "Traceback" not in snippet_proc.output(), snippet_proc.output()
