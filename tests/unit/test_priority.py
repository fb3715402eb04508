"""A training learner's lower CPU priority (p2p_diloco/priority.py): the autogroup text it parses, the
value it writes, and -- in a real child process that leads its own session -- that the thread's nice
value and the session's autogroup nice value both go up, while a process that does not lead its
session leaves the autogroup alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.learner.priority import (
    AUTOGROUP_PATH, JOINING_MAX_S, joining_done, lower_session_priority, lower_thread_priority, parse_autogroup_nice,
    raised_nice,
)

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 60.0


def test_parse_autogroup_nice() -> None:
    assert parse_autogroup_nice("/autogroup-4597 nice 0\n") == 0
    assert parse_autogroup_nice("/autogroup-12 nice -3") == -3
    assert parse_autogroup_nice("/autogroup-12 nice 19\n") == 19
    for bad in ("", "nice 0", "/autogroup-x nice 0", "/autogroup-1 nice", "/autogroup-1 nice 0 extra"):
        assert parse_autogroup_nice(bad) is None, bad


def test_raised_nice_is_capped_and_never_lowers() -> None:
    assert raised_nice(0, 5) == 5
    assert raised_nice(17, 5) == 19
    assert raised_nice(3, 0) == 3
    assert raised_nice(3, -4) == 3  # raising a priority is not what this is for


def test_priority_drops_at_the_first_contribution_or_after_the_limit() -> None:
    """A newcomer keeps its priority until its first committed round; one that never contributes (alone,
    or failing its rounds) lowers it after JOINING_MAX_S of training anyway."""
    assert not joining_done(False, 0.0)
    assert not joining_done(False, JOINING_MAX_S - 0.1)
    assert joining_done(True, 0.5)
    assert joining_done(False, JOINING_MAX_S)
    assert joining_done(False, 5.0, limit_s=4.0) and not joining_done(False, 3.0, limit_s=4.0)


def test_zero_changes_nothing(tmp_path: Path) -> None:
    fake = tmp_path / "autogroup"
    fake.write_text("/autogroup-1 nice 0\n")
    assert "unchanged" in lower_thread_priority(0)
    assert "unchanged" in lower_session_priority(0, autogroup=fake)
    assert fake.read_text() == "/autogroup-1 nice 0\n"


CHILD = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from p2p_diloco.learner.priority import AUTOGROUP_PATH, lower_session_priority, lower_thread_priority, parse_autogroup_nice
before, thread_before = parse_autogroup_nice(AUTOGROUP_PATH.read_text()), os.nice(0)
line = lower_thread_priority(4) + "; " + lower_session_priority(4)
print(before, thread_before, os.nice(0), parse_autogroup_nice(AUTOGROUP_PATH.read_text()), line, sep="|")
"""


def _run_child(new_session: bool) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S, start_new_session=new_session, check=True).stdout
    return out.strip().split("|")


@pytest.mark.skipif(not AUTOGROUP_PATH.exists(), reason="no autogroup scheduling on this kernel")
def test_session_leader_lowers_its_autogroup() -> None:
    before, thread_before, thread_after, after, line = _run_child(new_session=True)
    assert int(thread_after) == min(19, int(thread_before) + 4), line
    assert int(after) == min(19, int(before) + 4), line
    assert "autogroup at nice" in line


@pytest.mark.skipif(not AUTOGROUP_PATH.exists(), reason="no autogroup scheduling on this kernel")
def test_non_leader_leaves_the_shared_autogroup_alone() -> None:
    ours = parse_autogroup_nice(AUTOGROUP_PATH.read_text())
    before, thread_before, thread_after, after, line = _run_child(new_session=False)
    assert before == after == str(ours), line  # the session we share with pytest is untouched
    assert int(thread_after) == min(19, int(thread_before) + 4), line
    assert "left alone" in line
