"""The hivemind version check (p2p_diloco.hivemind_ext.require_hivemind): code that uses hivemind's
private names refuses, in one line naming both versions, to run on another hivemind release."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import p2p_diloco.hivemind_ext as hivemind_ext
from p2p_diloco.hivemind_ext import (
    ALLOW_MISMATCH_ENV,
    WRITTEN_FOR,
    HivemindVersionError,
    installed_hivemind_version,
    require_hivemind,
)

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 180.0  # a fresh interpreter importing hivemind's averager on a busy machine
GUARDED = (  # every module that overrides or reads hivemind private names, in import order
    "p2p_diloco.hivemind_ext.compression",
    "p2p_diloco.hivemind_ext.logfilters",
    "p2p_diloco.hivemind_ext.dial",
    "p2p_diloco.hivemind_ext.dhtpipe",
    "p2p_diloco.averaging.runner",
    "p2p_diloco.averaging.downloads",
    "p2p_diloco.averaging.fixed_groups",
    "p2p_diloco.averaging.group_leader",
    "p2p_diloco.averaging.verdicts",
    "p2p_diloco.averaging.process",
)


def test_the_pinned_version_is_the_one_written_for() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"hivemind=={WRITTEN_FOR}"' in pyproject
    assert installed_hivemind_version() == WRITTEN_FOR  # this checkout's install is the pinned one
    require_hivemind("tests")  # nothing raised


def test_another_version_is_one_line_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_MISMATCH_ENV, raising=False)
    with pytest.raises(HivemindVersionError) as info:
        require_hivemind("p2p_diloco.some_module", installed="1.2.0")
    message = str(info.value)
    assert "\n" not in message
    assert "p2p_diloco.some_module" in message and WRITTEN_FOR in message and "1.2.0" in message
    assert isinstance(info.value, ImportError)  # raised at import: an import that failed


def test_no_hivemind_at_all_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_MISMATCH_ENV, raising=False)
    monkeypatch.setattr(hivemind_ext, "installed_hivemind_version", lambda: None)
    with pytest.raises(HivemindVersionError, match="hivemind is not installed"):
        require_hivemind("x")


def test_the_override_warns_instead(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ALLOW_MISMATCH_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.hivemind_ext"):
        require_hivemind("x", installed="1.2.0")
    assert any("1.2.0" in r.getMessage() and WRITTEN_FOR in r.getMessage() for r in caplog.records)


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import importlib
import p2p_diloco.hivemind_ext as h
real = h.installed_hivemind_version
refused = {{}}
for name in {guarded!r}:
    h.installed_hivemind_version = lambda: "9.9.9"
    try:
        importlib.import_module(name)
        refused[name] = None
    except h.HivemindVersionError as e:
        refused[name] = str(e)
    h.installed_hivemind_version = real
    importlib.import_module(name)  # for real now: the next module imports this one
from p2p_diloco.hivemind_ext import procguard
h.installed_hivemind_version = lambda: "9.9.9"
try:
    procguard.install()
    refused["procguard.install"] = None
except h.HivemindVersionError as e:
    refused["procguard.install"] = str(e)
print(json.dumps(refused))
"""


def test_every_module_using_private_names_checks_at_import() -> None:
    code = CHILD.format(root=str(ROOT), guarded=GUARDED)
    env = {k: v for k, v in os.environ.items() if k != ALLOW_MISMATCH_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         check=True, env=env).stdout
    refused = json.loads(out.strip().splitlines()[-1])
    for name in GUARDED:
        assert refused[name] is not None and name in refused[name] and "9.9.9" in refused[name], (name, refused)
    assert refused["procguard.install"] is not None and "procguard" in refused["procguard.install"]


class _Records(logging.Handler):
    """Keeps every record that reaches it (attached to hivemind's logger itself: hivemind's loggers do
    not propagate to the root, where pytest's caplog listens unless hivemind was imported at collection)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_round_without_group_is_logged_without_a_traceback() -> None:
    """hivemind's averager logs a lone round with logger.exception; our filter drops exactly that record
    (the learner logs the round itself) and lets every other averaging failure through.
    (Moved here from test_averaging.py with the filter.)"""
    from hivemind.averaging.partition import AllreduceException

    from p2p_diloco.hivemind_ext.logfilters import AVERAGER_LOGGER, NO_GROUP_MESSAGE, quiet_expected_failures

    quiet_expected_failures()
    quiet_expected_failures()  # idempotent
    hv = logging.getLogger("hivemind.averaging.averager")
    assert hv is logging.getLogger(AVERAGER_LOGGER)
    assert sum(type(f).__name__ == "NoGroupIsNotAnError" for f in hv.filters) == 1
    captured = _Records()
    hv.addHandler(captured)
    try:
        for e in (AllreduceException(NO_GROUP_MESSAGE), AllreduceException("partial all-reduce: a reducer failed")):
            try:
                raise e
            except AllreduceException as caught:
                hv.exception(caught)
    finally:
        hv.removeHandler(captured)
    assert [r.getMessage() for r in captured.records] == ["partial all-reduce: a reducer failed"]
    assert captured.records[0].exc_info is not None  # other failures keep their traceback
