"""Checkpoints: round trip, retention, fallback past corruption, disk full, kill -9 mid-save, strict loading."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.learner import checkpoint as ck
from p2p_diloco.learner.checkpoint import (
    FORMAT_VERSION, Checkpoint, list_checkpoints, load_checkpoint, save_checkpoint, tensors_digest,
)
from procs import ProcGroup

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 60.0
"""Generous: the child imports torch on a possibly busy machine."""


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "step_count": torch.tensor(seed, dtype=torch.int64),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip(tmp_path: Path) -> None:
    t = _tensors(1)
    path = save_checkpoint(tmp_path, 7, t, {"config_hash": "abc", "peer": "p1"})
    assert path == tmp_path / "ckpt-00000007"
    for ckpt in (load_checkpoint(path), load_checkpoint(tmp_path)):
        assert isinstance(ckpt, Checkpoint) and ckpt.path == path and ckpt.step == 7
        _assert_same(t, ckpt.tensors)
        assert ckpt.manifest["config_hash"] == "abc" and ckpt.manifest["peer"] == "p1"
        assert ckpt.manifest["format"] == FORMAT_VERSION
        assert ckpt.manifest["tensor_names"] == ["b", "step_count", "w"]
        assert ckpt.manifest["bytes"] == (path / "tensors.safetensors").stat().st_size
        assert tensors_digest(ckpt.tensors) == tensors_digest(t)
    assert tensors_digest(t) != tensors_digest(_tensors(2))
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "tensors.safetensors"]


def test_keep_prunes_oldest_and_lists_newest_first(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, _tensors(step), {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000040", "ckpt-00000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000030", "ckpt-00000040"]
    assert list_checkpoints(tmp_path / "missing") == []
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_checkpoint(tmp_path, 50, _tensors(5), {}, keep=0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest"])
def test_corrupt_newest_falls_back_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1), {})
    newest = save_checkpoint(tmp_path, 2, _tensors(2), {})
    file = newest / "tensors.safetensors"
    if damage == "flip":
        _flip_byte(file)
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:-7])
    else:
        (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.learner.checkpoint"):
        ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1
    _assert_same(ckpt.tensors, _tensors(1))
    assert any("ckpt-00000002" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with pytest.raises(ValueError, match="ckpt-00000002"):
        load_checkpoint(newest)  # a folder named explicitly never falls back

    _flip_byte(tmp_path / "ckpt-00000001" / "tensors.safetensors", offset=100)
    with pytest.raises(ValueError, match=r"none of 2 verifies") as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_prune_keeps_the_newest_valid_and_deletes_corrupt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After --resume fell back past a corrupt ckpt-200 to ckpt-100, the next saves (steps 150, 160) must keep
    valid checkpoints, not the corrupt one (by step alone, 200 would be kept and 100 deleted)."""
    for step in (100, 200):
        save_checkpoint(tmp_path, step, _tensors(step), {}, keep=2)
    _flip_byte(tmp_path / "ckpt-00000200" / "tensors.safetensors")
    assert load_checkpoint(tmp_path).step == 100  # the fall-back
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.learner.checkpoint"):
        save_checkpoint(tmp_path, 150, _tensors(150), {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000150", "ckpt-00000100"]
    assert any("deleting corrupt checkpoint" in r.getMessage() and "ckpt-00000200" in r.getMessage()
               for r in caplog.records)
    save_checkpoint(tmp_path, 160, _tensors(160), {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000160", "ckpt-00000150"]
    assert load_checkpoint(tmp_path).step == 160

    # keep=1 with a corrupt newer one and a valid older one: the one just saved stays, both others go
    _flip_byte(tmp_path / "ckpt-00000160" / "tensors.safetensors")
    save_checkpoint(tmp_path, 155, _tensors(155), {}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000155"]


def test_a_corrupt_checkpoint_of_the_same_step_is_replaced(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 100, _tensors(1), {})
    path = save_checkpoint(tmp_path, 200, _tensors(2), {})
    _flip_byte(path / "tensors.safetensors")
    save_checkpoint(tmp_path, 200, _tensors(3), {})  # the resumed learner reached step 200 again
    _assert_same(load_checkpoint(tmp_path).tensors, _tensors(3))
    with pytest.raises(ValueError, match="already exists"):  # a valid one is never replaced
        save_checkpoint(tmp_path, 200, _tensors(4), {})


def _enospc(*_args: Any, **_kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["save_file", "manifest", "before_rename"])
def test_disk_full_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1), {"config_hash": "abc"})
    fired: list[str] = []
    hook = None
    if where == "save_file":
        real = ck.save_file

        def partial_then_full(tensors: dict[str, torch.Tensor], filename: str) -> None:
            fired.append(filename)
            real(tensors, filename)
            Path(filename).write_bytes(Path(filename).read_bytes()[:50])  # a partial file is left behind
            _enospc()

        monkeypatch.setattr(ck, "save_file", partial_then_full)
    elif where == "manifest":
        real_dump = json.dump

        def dump_then_full(obj: Any, fp: Any, **kw: Any) -> None:
            fired.append("manifest")
            real_dump(obj, fp, **kw)
            _enospc()

        monkeypatch.setattr(ck.json, "dump", dump_then_full)
    else:

        def hook(tmp: Path) -> None:
            fired.append(str(tmp))
            _enospc()

    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, 2, _tensors(2), {"config_hash": "abc"}, _before_rename=hook)
    monkeypatch.undo()
    assert fired, "the fault did not fire"
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001"]  # no .tmp-* left
    ckpt = load_checkpoint(tmp_path, expect={"config_hash": "abc"})
    assert ckpt.step == 1
    _assert_same(ckpt.tensors, _tensors(1))


_CHILD = """
import sys, time
from pathlib import Path
import torch
from p2p_diloco.learner.checkpoint import save_checkpoint
root = Path(sys.argv[1])
save_checkpoint(root, 1, {"w": torch.arange(6.0).reshape(2, 3)}, {"who": "child"})
def hang(tmp):
    print("ready", tmp, flush=True)
    time.sleep(3600)  # the state under test: mid-save, until the test kills us
save_checkpoint(root, 2, {"w": torch.zeros(2, 3)}, {"who": "child"}, _before_rename=hang)
"""


def test_kill_9_during_save_leaves_previous_intact(tmp_path: Path, procs: ProcGroup) -> None:
    env = {**procs.env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = procs.start([sys.executable, "-c", _CHILD, str(tmp_path)], "saver", env)
    stale = Path(child.wait_for(r"^ready (.+)$", CHILD_TIMEOUT_S).group(1).strip())
    child.popen.kill()  # SIGKILL, mid-save: files written, not renamed
    child.popen.wait(timeout=CHILD_TIMEOUT_S)
    assert child.popen.returncode == -9
    assert stale.is_dir() and stale.name.startswith(".tmp-ckpt-2-")
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-00000001"]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and ckpt.manifest["who"] == "child"
    assert torch.equal(ckpt.tensors["w"], torch.arange(6.0).reshape(2, 3))

    save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, {})
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001", "ckpt-00000003"]


def test_temp_folder_of_a_live_process_is_left_alone(tmp_path: Path) -> None:
    live = tmp_path / ".tmp-ckpt-9-1"  # pid 1 is always alive
    live.mkdir(parents=True)
    save_checkpoint(tmp_path, 1, _tensors(1), {})
    assert live.is_dir()


def test_strict_loading(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 5, _tensors(5), {"config_hash": "abc"})
    assert load_checkpoint(tmp_path, expect={"config_hash": "abc"}).step == 5
    with pytest.raises(ValueError, match=r"config_hash is 'abc', expected 'xyz'"):
        load_checkpoint(tmp_path, expect={"config_hash": "xyz"})
    with pytest.raises(ValueError, match=r"run_id is '<missing>'"):
        load_checkpoint(path, expect={"run_id": "r1"})
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no complete ckpt-"):
        load_checkpoint(tmp_path / "empty")

    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=rf"format is {FORMAT_VERSION + 1}, expected {FORMAT_VERSION}"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="none of 1 verifies"):
        load_checkpoint(tmp_path)


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1), {})
    before = (tmp_path / "ckpt-00000001" / "tensors.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(tmp_path, 1, _tensors(2), {})
    assert (tmp_path / "ckpt-00000001" / "tensors.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, 2, _tensors(2), {"step": 3})
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 2, _tensors(2), {"x": object()})
    with pytest.raises(ValueError, match="step must be"):
        save_checkpoint(tmp_path, -1, _tensors(2), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001"]


def test_caller_tensors_not_aliased(tmp_path: Path) -> None:
    w = torch.randn(3, 4, requires_grad=True)
    base = torch.arange(12.0).reshape(3, 4)
    t = {"w": w, "t": base.t(), "tied": base}  # non-contiguous view sharing storage with "tied"
    assert not t["t"].is_contiguous()
    expected = {k: v.detach().clone() for k, v in t.items()}
    save_checkpoint(tmp_path, 1, t, {})
    with torch.no_grad():
        w.add_(1.0)
    base.zero_()
    ckpt = load_checkpoint(tmp_path)
    _assert_same(ckpt.tensors, expected)
    assert not ckpt.tensors["w"].requires_grad
