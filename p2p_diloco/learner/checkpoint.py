"""Learner checkpoints on local disk: atomic save, verified load, fallback past a corrupt newest one.

Layout under a root directory::

    root/ckpt-00000120/tensors.safetensors   every tensor, contiguous, on CPU (safetensors format)
    root/ckpt-00000120/manifest.json         caller's meta + format, step, created, tensors_sha256,
                                             tensor_names (sorted), bytes (size of the tensors file);
                                             a learner's meta holds its run config under ``config``
                                             (:func:`portable_config`), which ``p2p-diloco export`` reads
    root/.tmp-ckpt-<step>-<pid>/             a save in progress, or left behind by a kill -9

Atomicity: a save writes both files into a temp folder, fsyncs each file and the folder, renames
the folder to ``ckpt-<step:08d>`` (one atomic ``rename(2)``) and fsyncs the root so the rename is
durable. A crash before the rename leaves only a ``.tmp-*`` folder, which loaders never look at
and the next save deletes; after it, the checkpoint is complete. Loaders only consider ``ckpt-*``
folders and verify the manifest and the sha256 of the tensors file, so a checkpoint damaged later
(bit rot, a truncated copy) is skipped in favour of the previous one. Saving a step that already
exists raises ``ValueError``: POSIX has no atomic replace of a non-empty directory, and a swap
through a second rename would leave a window with no checkpoint of that step at all.

A running unit's side (the end of this module): what goes into one (:func:`checkpoint_state`: the weights, the inner
optimizer's state and :meth:`DiLoCo.state_dict`), resuming from one (:func:`restore`, through
:meth:`DiLoCo.load_state_dict`), the periodic and final saves of ``p2p-diloco join`` (:class:`Checkpointer`), and a
library loop's :func:`save` and :func:`resume`: one format, one path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.core import events
from p2p_diloco.core.config import Config
from p2p_diloco.core.devices import load_into, state_to_device, state_to_host, to_host

if TYPE_CHECKING:
    from p2p_diloco.engine.engine import DiLoCo
    from p2p_diloco.engine.options import LearnerOptions

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
RESERVED_KEYS = ("format", "step", "created", "tensors_sha256", "tensor_names", "bytes")
_CKPT_RE = re.compile(r"ckpt-(\d{8,})")
_TMP_RE = re.compile(r"\.tmp-ckpt-(\d+)-(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its folder, its manifest and its tensors (on CPU)."""

    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """First 16 hex chars of a sha256 over sorted names, dtypes, shapes and bytes (pure, for "same state?")."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def portable_config(cfg: Config) -> dict[str, Any]:
    """The run config as plain JSON data for a manifest's ``config``, self-contained so that a checkpoint
    rebuilds its model on a machine without the run's local files: an hf model's ``model.hf_config`` is the
    resolved transformers architecture inline (a table, whatever file it came from) and ``model.init_from``
    is dropped (every weight is in the checkpoint). The model it builds is the run's; its
    :func:`~p2p_diloco.core.identity.config_hash` differs from the run's only where ``init_from`` was set. The data are
    pinned (:func:`~p2p_diloco.core.identity.pin_data`: dataset fingerprint, tokenizer hash), so the hash needs no data."""
    from p2p_diloco.core.identity import pin_data

    data = pin_data(cfg).to_dict()
    if cfg.model.kind == "hf":
        from p2p_diloco.core import hfmodel

        data["model"] = {**data["model"], "hf_config": hfmodel.architecture(cfg.model), "init_from": ""}
    return json.loads(json.dumps(data))  # tuples become lists: what a manifest reads back


def save_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    keep: int = 2,
    *,
    _before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Atomically write ``root/ckpt-<step:08d>``, then prune to the ``keep`` newest valid ones (corrupt ones
    are deleted: a loader skips them anyway) and remove stale temps. An existing checkpoint of the same
    step is replaced only if it is corrupt (after ``--resume`` fell back past it).

    On any error the temp folder is removed, earlier checkpoints are untouched and the error propagates.
    ``_before_rename`` (tests only) is called with the temp folder once its files are durable.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    clash = sorted(set(meta) & set(RESERVED_KEYS))
    if clash:
        raise ValueError(f"meta keys {clash} are reserved for the manifest")
    bad = sorted(str(k) for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(f"tensors must map str to torch.Tensor; bad entries: {bad}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta is not JSON-serializable: {e}") from e
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:08d}"
    if final.exists():
        try:
            _verified(final, load=False)
        except ValueError as e:  # nothing valid is lost: loaders skip it
            log.warning("replacing corrupt checkpoint %s: %s", final, e)
            shutil.rmtree(final)
        else:
            raise ValueError(f"checkpoint {final} already exists; steps are saved once")
    # Clone: contiguous, detached, on CPU, never sharing storage with the caller (or with each other,
    # which safetensors refuses).
    cpu = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    tmp = root / f".tmp-ckpt-{step}-{os.getpid()}"
    if tmp.exists():  # our own pid, from an earlier process that had it
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        save_file(cpu, str(tmp / TENSORS_FILE))
        _fsync_path(tmp / TENSORS_FILE)
        manifest = {
            **meta,
            "format": FORMAT_VERSION,
            "step": step,
            "created": time.time(),
            "tensors_sha256": _sha256_file(tmp / TENSORS_FILE),
            "tensor_names": sorted(cpu),
            "bytes": (tmp / TENSORS_FILE).stat().st_size,
        }
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if _before_rename is not None:
            _before_rename(tmp)
        os.rename(tmp, final)
        _fsync_path(root)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        raise
    _prune(root, keep, final)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete ``ckpt-*`` folders under ``root``, highest step first (``[]`` if root does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT_RE.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]


def load_checkpoint(path: Path, expect: dict[str, Any] | None = None) -> Checkpoint:
    """Load one ``ckpt-*`` folder, or the newest checkpoint under a root that verifies.

    Under a root, checkpoints that fail verification are skipped with a warning. ``expect`` maps
    manifest keys to required values; a mismatch raises (it is never a reason to fall back).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint path {path} does not exist")
    if _CKPT_RE.fullmatch(path.name) or (path / MANIFEST_FILE).exists():
        ckpt = _verified(path)
    else:
        candidates = list_checkpoints(path)
        if not candidates:
            raise ValueError(f"checkpoint root {path}: no complete ckpt-* folder")
        reasons: list[str] = []
        for candidate in candidates:
            try:
                ckpt = _verified(candidate)
                break
            except ValueError as e:
                log.warning("skipping checkpoint %s: %s", candidate, e)
                reasons.append(str(e))
        else:
            raise ValueError(f"checkpoint root {path}: none of {len(candidates)} verifies; newest: {reasons[0]}")
    for key, want in (expect or {}).items():
        have = ckpt.manifest.get(key, "<missing>")
        if have != want:
            raise ValueError(f"checkpoint {ckpt.path}: {key} is {have!r}, expected {want!r}")
    return ckpt


def _verified(folder: Path, load: bool = True) -> Checkpoint:
    """Read and verify one checkpoint folder; ``ValueError`` naming the folder and the fault. Without
    ``load`` the tensors are hashed but not loaded (``tensors`` is empty)."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {folder}: manifest.json unreadable: {e}") from e
    if not isinstance(manifest, dict) or any(k not in manifest for k in RESERVED_KEYS):
        raise ValueError(f"checkpoint {folder}: manifest.json lacks one of {list(RESERVED_KEYS)}")
    if manifest["format"] != FORMAT_VERSION:
        raise ValueError(f"checkpoint {folder}: format is {manifest['format']!r}, expected {FORMAT_VERSION}")
    m = _CKPT_RE.fullmatch(folder.name)
    if m and int(m.group(1)) != manifest["step"]:
        raise ValueError(f"checkpoint {folder}: manifest step {manifest['step']!r} does not match the folder name")
    try:
        digest = _sha256_file(folder / TENSORS_FILE)
    except OSError as e:
        raise ValueError(f"checkpoint {folder}: {TENSORS_FILE} unreadable: {e}") from e
    if digest != manifest["tensors_sha256"]:
        raise ValueError(f"checkpoint {folder}: {TENSORS_FILE} sha256 mismatch (corrupt or truncated)")
    if not load:
        return Checkpoint(path=folder, manifest=manifest, tensors={})
    tensors = load_file(str(folder / TENSORS_FILE), device="cpu")
    if sorted(tensors) != manifest["tensor_names"]:
        raise ValueError(f"checkpoint {folder}: tensor names differ from the manifest's")
    return Checkpoint(path=folder, manifest=manifest, tensors=tensors)


def _prune(root: Path, keep: int, just_saved: Path) -> None:
    """Keep the ``keep`` newest checkpoints that verify (``just_saved`` always counts as one); delete the
    ones that do not verify and everything older than the kept ones, and temps of dead processes.

    By step, not by validity, a corrupt newer checkpoint (one ``--resume`` fell back past) would be kept
    and the valid ones deleted. Newest first, each is verified until ``keep`` valid ones are found: one
    hash of the previous checkpoint per save in the usual case. Housekeeping after a successful save: a
    failure here is logged, not raised, because the new checkpoint is complete and durable and the caller
    must not think the save failed.
    """
    doomed: list[Path] = []
    valid = 0
    for p in list_checkpoints(root):
        if p == just_saved:
            valid += 1
        elif valid >= keep:
            doomed.append(p)
        else:
            try:
                _verified(p, load=False)
            except ValueError as e:
                log.warning("deleting corrupt checkpoint %s: %s", p, e)
                doomed.append(p)
            else:
                valid += 1
    for p in root.iterdir():
        m = _TMP_RE.fullmatch(p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(2))):
            doomed.append(p)
    for p in doomed:
        try:
            shutil.rmtree(p)
        except OSError as e:
            log.warning("could not delete old checkpoint folder %s: %s", p, e)


def _pid_alive(pid: int) -> bool:
    """Whether another live process has this pid (its temp folder may be a save in progress)."""
    if pid == os.getpid():
        return False  # our own save has renamed its temp already: anything left is stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (the latter makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- a running learner's checkpoints



class Owner(Protocol):
    """What the checkpointer asks of its unit (:class:`~p2p_diloco.learner.loop.Learner` is one; a protocol, because
    the learner builds its checkpointer: it imports this module, not the other way round)."""

    opts: LearnerOptions

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...
    def log_event(self, event: events.Event) -> None: ...


ENGINE_KEYS = ("config_hash", "inner_step", "tokens", "versions", "since_tokens", "since_steps")
"""The manifest fields that hold a :meth:`DiLoCo.state_dict`'s counts (its tensors: ``anchor/``, ``momentum/``)."""


def engine_files(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A :meth:`~p2p_diloco.engine.engine.DiLoCo.state_dict` as a checkpoint lays it out: ``anchor/<name>`` and
    ``momentum/<name>`` tensors, and the manifest's :data:`ENGINE_KEYS` (one list entry per fragment)."""
    frags = state["fragments"]
    tensors: dict[str, torch.Tensor] = {}
    for frag in frags:
        tensors.update({f"anchor/{n}": t for n, t in frag["anchor"].items()})
        tensors.update({f"momentum/{n}": t for n, t in frag["momentum"].items()})
    meta = {"config_hash": state["config_hash"], "inner_step": state["step"], "tokens": state["tokens"],
            "versions": [f["version"] for f in frags], "since_tokens": [f["since_tokens"] for f in frags],
            "since_steps": [f["since_steps"] for f in frags]}
    return tensors, meta


def engine_state(ckpt: Checkpoint, layout: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The :meth:`~p2p_diloco.engine.engine.DiLoCo.state_dict` a checkpoint holds, its fragments laid out as
    ``layout`` (each fragment's tensor names: the engine's), for :meth:`DiLoCo.load_state_dict`, which checks it.
    Raises ``ValueError`` (one line) for a checkpoint that lacks a field, a fragment or an anchor."""
    m, t = ckpt.manifest, ckpt.tensors
    absent = [k for k in ENGINE_KEYS if k not in m]
    if absent:
        raise ValueError(f"checkpoint {ckpt.path}: its manifest lacks {', '.join(absent)}")
    if any(not isinstance(m[k], list) or len(m[k]) != len(layout) for k in ENGINE_KEYS[3:]):
        raise ValueError(f"checkpoint {ckpt.path}: not this model's ({len(m['versions'])} fragments, this run has "
                         f"{len(layout)})")
    missing = [n for names in layout for n in names if f"anchor/{n}" not in t]
    if missing:
        raise ValueError(f"checkpoint {ckpt.path}: not this model's (no anchor of {missing[:3]})")
    return {"config_hash": m["config_hash"], "step": m["inner_step"], "tokens": m["tokens"],
            "fragments": [{"version": m["versions"][i], "anchor": {n: t[f"anchor/{n}"] for n in names},
                           "momentum": {n: t[f"momentum/{n}"] for n in names if f"momentum/{n}" in t},
                           "since_tokens": m["since_tokens"][i], "since_steps": m["since_steps"][i]}
                          for i, names in enumerate(layout)]}


def checkpoint_state(diloco: DiLoCo, optimizer: Any, meta: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                                                         dict[str, Any]]:
    """Everything a resumed unit needs, as flat host tensors (copies) and JSON metadata: the weights
    (``model/<name>``), the inner optimizer's state by parameter name (``adam/<name>/<key>``) and the engine's
    :meth:`~p2p_diloco.engine.engine.DiLoCo.state_dict` (:func:`engine_files`); ``meta`` adds the unit's own fields
    (``p2p-diloco join``'s name and shard). One format for ``join`` and a library loop (:func:`save`)."""
    params = diloco.params
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # host copies: a checkpoint is the same file whatever device wrote it
        for n, theta in to_host(params).items():
            tensors[f"model/{n}"] = theta
            for k, v in state_to_host(optimizer.state.get(params[n], {})).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"adam/{n}/{k}"] = v
    engine, engine_meta = engine_files(diloco.state_dict())
    tensors.update(engine)
    return tensors, {**meta, **engine_meta, "run_id": diloco.local.run_id, "peer_id": diloco.joined.peer_id,
                     "anchor_hashes": diloco.anchor_hashes, "model_digest": model_digest(params),
                     "config": portable_config(diloco.cfg)}  # what `p2p-diloco export` rebuilds the model from


def model_digest(params: Mapping[str, torch.Tensor]) -> str:
    """:func:`~p2p_diloco.learner.checkpoint.tensors_digest` of the weights, as a checkpoint's manifest records it."""
    return tensors_digest({f"model/{n}": theta for n, theta in to_host(params).items()})


def restore(diloco: DiLoCo, optimizer: Any, ckpt: Checkpoint) -> str:
    """Resume a unit from a verified checkpoint of this run (:func:`load_checkpoint`): the engine's state through
    :meth:`~p2p_diloco.engine.engine.DiLoCo.load_state_dict` (checked whole, then applied to every fragment or none,
    then advertised), the weights, and the inner optimizer's state by parameter name. The anchors must hash to the
    manifest's before anything is applied (nothing unverified is advertised), and the restored weights after; returns
    the weights' digest."""
    from p2p_diloco.averaging.decisions import anchor_hash

    params, t = diloco.params, ckpt.tensors
    missing = [n for n in params if f"model/{n}" not in t]
    if missing:
        raise ValueError(f"checkpoint {ckpt.path}: not this model's (no weights of {missing[:3]})")
    state = engine_state(ckpt, [s.names for s in diloco.slots])
    if [anchor_hash(f["anchor"]) for f in state["fragments"]] != list(ckpt.manifest.get("anchor_hashes", ())):
        raise ValueError(f"checkpoint {ckpt.path}: its anchors do not hash to its manifest's anchor_hashes")
    diloco.load_state_dict(state)
    with torch.no_grad():
        load_into(params, {n: t[f"model/{n}"] for n in params})
        for n, p in params.items():
            adam = {k.rsplit("/", 1)[1]: v for k, v in t.items() if k.startswith(f"adam/{n}/")}
            if adam:
                optimizer.state[p] = state_to_device(adam, p.device)
    digest = model_digest(params)
    if digest != ckpt.manifest.get("model_digest"):
        raise ValueError(f"checkpoint {ckpt.path}: the restored weights hash to {digest}, its manifest says "
                         f"{ckpt.manifest.get('model_digest')}")
    return digest


def save(diloco: DiLoCo, optimizer: Any, root: str | Path, keep: int = 2) -> Path:
    """A library loop's checkpoint of its unit under ``root`` (``root/ckpt-<step>``, atomic; the ``keep`` newest
    kept): the format ``p2p-diloco join --checkpoint-dir`` writes, so either resumes from the other's
    (``join --resume``, :func:`resume`). Returns the checkpoint's folder."""
    tensors, meta = checkpoint_state(diloco, optimizer, {"name": diloco.joined.name, "shard": None, "num_shards": 1})
    return save_checkpoint(Path(root), diloco.inner_step, tensors, meta, keep)


def resume(diloco: DiLoCo, optimizer: Any, path: str | Path) -> Checkpoint:
    """Resume a library loop's unit from the newest verified checkpoint under ``path`` (or that ``ckpt-*``
    folder), written by :func:`save` or by ``p2p-diloco join``: it must be of this run (config hash, run id).
    Restores the engine, the model's weights and ``optimizer``'s state (:func:`restore`); returns the checkpoint."""
    ckpt = load_checkpoint(Path(path), expect={"config_hash": diloco.local.config_hash, "run_id": diloco.local.run_id})
    restore(diloco, optimizer, ckpt)
    return ckpt


class Checkpointer:
    """Periodic checkpoints written by a background thread (the inner loop only pays for the copies),
    and a final one, written in the foreground, when the learner leaves."""

    def __init__(self, learner: Owner) -> None:
        assert learner.opts.checkpoint_dir is not None
        self.learner, self.root = learner, learner.opts.checkpoint_dir
        self.every_s = learner.opts.checkpoint_every_s
        self.last = time.monotonic()
        self.saved_step: int | None = None
        """The step of the last checkpoint this learner wrote."""
        self._thread: threading.Thread | None = None

    def maybe_save(self) -> None:
        """(inner loop) Start a background save when one is due and none is running."""
        if self.every_s <= 0 or time.monotonic() - self.last < self.every_s:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self.last = time.monotonic()
        tensors, meta = self.learner.checkpoint_state()
        self._thread = threading.Thread(target=self._write, args=(tensors, meta), name="checkpoint", daemon=True)
        self._thread.start()

    def save(self, final: bool = False) -> None:
        """(foreground) Wait for a background save, then write the current state."""
        if self._thread is not None:
            self._thread.join()
        tensors, meta = self.learner.checkpoint_state()
        if meta["inner_step"] == self.saved_step:
            return  # this step is on disk already
        self._write(tensors, meta, final=final)

    def _write(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], final: bool = False) -> None:
        t0 = time.monotonic()
        try:
            path = save_checkpoint(self.root, int(meta["inner_step"]), tensors, meta)
        except Exception as e:  # disk full, permissions: training goes on; the previous checkpoint is intact
            log.error("checkpoint at step %d NOT saved (%s: %s); the previous one is intact", meta["inner_step"],
                         type(e).__name__, e)
            self.learner.log_event(events.CheckpointEvent(outcome="failed", reason=f"{type(e).__name__}: {e}"[:300]))
            return
        self.saved_step = int(meta["inner_step"])
        log.info("checkpoint saved: %s (step %d, model %s, %.2f s)%s", path, meta["inner_step"], meta["model_digest"],
                    time.monotonic() - t0, " (final)" if final else "")
        self.learner.log_event(events.CheckpointEvent(outcome="saved", path=str(path), final=final,
                                                   model_digest=meta["model_digest"],
                                                   anchor_hashes=tuple(meta["anchor_hashes"])))
