"""The learner unit: inner AdamW steps on its own data stream, fragments averaged in the background.

Decoupled DiLoCo (arXiv 2604.21428) without its syncer. The loop below reads top to bottom:

1. one inner AdamW step on this learner's data stream (the whole training split in its own order, or an
   explicit shard; padded to the profile's speed);
2. which fragments are due: at instants of the swarm's DHT clock (:mod:`p2p_diloco.net.clock`; its
   period fixed, or derived from the learners' step times and published by one of them), or by
   our own step count (numbered like the swarm's when we join one that is training);
3. hand each due fragment's encoded pseudo-gradient ``anchor - theta`` to its averager -- a
   background round, never waited for;
4. apply what came back: a committed round moves the anchor by the outer Nesterov step and is
   alpha-mixed into the weights at least ``outer.overlap`` (tau) steps after it was sent; a
   discarded round changes nothing (the pseudo-gradient is still measured against the unchanged
   anchor and goes out again at the next round);
5. catch up: a fragment whose anchor the swarm has moved past (a newer version in the peer
   records, or -- after a fork -- the winning anchor of our version) is downloaded from a peer
   that has it and our progress is *rebased* onto it, ``theta <- new_anchor + (theta - old_anchor)``,
   so no local work is lost; a fragment being downloaded sits out its due round;
6. publish our record (step, tokens, speed, versions, bytes, loss) from a background thread.

The time the loop spends on 3-5 (copies, outer steps; never network waits) is measured as
*blocked* time. At the end every fragment with unsynced progress gets a final round, then the
learner lingers until the live peers agree on the fragment versions, and prints one ``final``
JSON line (anchor hashes, eval loss of the anchors before and after, rounds, blocked time).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from p2p_diloco.core import data
from p2p_diloco.core.config import Config
from p2p_diloco.engine.metrics import MetricsSpec

logger = logging.getLogger(__name__)

START_MARGIN_S = 2.0
"""How far ahead a learner proposes the common start (covers DHT propagation of the proposals)."""
CLOCK_START_MARGIN_S = 2.0
"""A newly derived sync clock starts this far beyond :data:`CLOCK_READ_EVERY` of the leader's ``view_period_s`` in
the future: the followers read the clock at every such head probe, and the read itself takes time."""
CLOCK_READ_EVERY = 3
"""A follower's head probes read the sync clock once in this many (and at any probe that reads a fragment's vouches:
the same search carries it), its leader's at every one. A clock read at every probe, mostly alone, was a tenth of a
learner's control-plane bytes at N = 4 (455 B/s); a retune starts this many view periods ahead instead of one."""
CLOCK_WARMUP_STEPS = 3
"""A learner's step time is measured over at least this many steps (0, unknown, before)."""
CLOCK_SKIP_STEPS = 5
"""... after its first this many training steps, which are left out: lazy initialisation, and every learner of a
swarm starting at once. With them, 4 learners on 2 cores derived a first clock of 20.8 s (0.74 s a step over the
first 8 steps, the median of the 4), where they then ran at about 0.55 s a step: the first rounds came a period of
20.8 s after the clock instead of about 15 s, and every round after them too (within the retune tolerance)."""
CLOCK_REPUBLISH_S = 60.0
"""The clock leader re-stores the current clock this often (it expires after ``clock.CLOCK_TTL_S``)."""
CLOCK_LEADER_FRESH_S = 1.5 * CLOCK_REPUBLISH_S
"""A clock stored this recently by a peer with a smaller id than ours says it is alive and leads, whatever our view
holds (:func:`~p2p_diloco.net.clock.defers_to_publisher`)."""
SPEED_WINDOW_S = 10.0
"""Published tokens/s are measured over this much recent wall time (one status period is too noisy)."""
JOIN_VIEW_FRESH_S = 3.0
"""A newcomer acts on the swarm view it read when joining if it is at most this old (a read under load
takes 0.5-0.8 s), else it reads again."""
ROUND_POLL_S = 0.25
"""Blocking mode: how often a wait for a round checks for a stop signal."""
QUICK_EVAL_BATCHES = 2
"""Held-out batches of a periodic evaluation (``--eval-every``): a quarter of the default eval set, cheap."""
LEARNER_STATES = ("joining", "training", "averaging", "syncing", "leaving")
"""Record states of learners (``idle`` is the heartbeat stand-in; ``leaving``: done, lingering for peers)."""


@dataclass(frozen=True)
class Profile:
    """A kind of machine (``peers/NAME.toml``): how fast this learner steps and how many threads it uses."""

    name: str = "default"
    slowdown: float = 1.0
    """Each inner step takes this many times its natural time (the rest is slept): 3.0 = a 3x slower machine."""
    min_step_s: float = 0.0
    """Pad every inner step to at least this many seconds before ``slowdown`` (a steady pace for tests)."""
    threads: int = 0
    """torch threads; 0 = one (several learners share a machine; more would measure thread thrashing)."""

    def __post_init__(self) -> None:
        if not self.name or self.slowdown < 1.0 or self.min_step_s < 0 or self.threads < 0:
            raise ValueError(f"profile needs a name, slowdown >= 1, min_step_s >= 0, threads >= 0; got {self}")

    def pad(self, natural_s: float) -> None:
        """Sleep what it takes for a step that took ``natural_s`` seconds to take this machine's time."""
        pace = max(natural_s, self.min_step_s) * self.slowdown
        if pace > natural_s:
            time.sleep(pace - natural_s)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{p}: profile not found") from None
        except IsADirectoryError:
            raise ValueError(f"{p}: a folder, not a profile file") from None
        except OSError as e:
            raise ValueError(f"{p}: cannot read the profile ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{p}: not a text file (a profile is TOML)") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: not valid TOML ({e})") from None
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(f"{p}: unknown profile key(s) {sorted(unknown)} (known: {sorted(known)})")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            kind, what = {"str": (str, "a string"), "float": (float, "a number"), "int": (int, "an integer")}[str(known[key])]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{p}: {key} must be {what}, got {value!r}")
            values[key] = value
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None


@dataclass(frozen=True)
class SyncOptions:
    """A unit's choices for its engine (:class:`~p2p_diloco.engine.engine.DiLoCo`) that are not part of the run's
    config (they do not change its hash). Every default suits a library user's own loop."""

    events_path: Path | None = None
    """Append every event, one JSON line each (``--events``)."""
    metrics: tuple[MetricsSpec, ...] = ()
    """Metric sinks fed from the same events as ``events_path`` (``--metrics tensorboard:DIR``)."""
    wait_peers: int = 0
    """Wait until this many learners (us included) are live before the first step."""
    wait_peers_timeout_s: float = 120.0
    """Give up waiting for ``wait_peers`` (an error) after this many seconds, unless ``max_time_s`` ends first."""
    wait_peers_report_s: float = 10.0
    """While waiting for peers, log how many are live this often."""
    linger_s: float = 20.0
    """After the final rounds, wait at most this long for the live peers to agree on fragment versions."""
    final_wait_s: float = 25.0
    """Leaving, a fragment's final round goes only to a boundary of the sync clock at most this long after training
    ended (the rounds still in flight are waited for first); one further off is skipped (its last round was less than
    a period before it: that progress stays unsynced). Only long sync periods (a slow link's) skip any."""
    status_period_s: float = 1.0
    """How often the background thread wakes: it publishes our record when :func:`publish_due` and reads
    the swarm when :func:`view_due`."""
    view_period_s: float = 3.0
    """While training: seconds between reads of the swarm and of the sync clock (:func:`view_due`)."""
    serve_s: float = 0.0
    """After the linger, stay this long (record alive, state shared) for newcomers to download from us."""
    blocking: bool = False
    """Wait for every round handed off before the next inner step (synchronous, OpenDiLoCo-style DiLoCo:
    a baseline for the benchmarks; the decoupled default never waits)."""
    max_time_s: float = 0.0
    """The unit's time budget, counted from ``started_at`` (0 = no limit): a wait for peers ends with it, and
    our learner stops training when it runs out (the wait and the start-up count too)."""
    started_at: float = field(default_factory=time.monotonic)
    """When the unit started (monotonic): time to first contribution is measured from here."""

    def __post_init__(self) -> None:
        """One line naming the first field that is not of its type and range (``TypeError`` / ``ValueError``)."""
        if self.events_path is not None and not isinstance(self.events_path, Path):
            if not isinstance(self.events_path, str):
                raise TypeError(f"SyncOptions.events_path must be a path or None, got {type(self.events_path).__name__}")
            object.__setattr__(self, "events_path", Path(self.events_path))
        if not isinstance(self.metrics, (tuple, list)) or not all(isinstance(m, MetricsSpec) for m in self.metrics):
            raise TypeError("SyncOptions.metrics must be a tuple of MetricsSpec (p2p_diloco.engine.metrics)")
        object.__setattr__(self, "metrics", tuple(self.metrics))
        if not isinstance(self.wait_peers, int) or isinstance(self.wait_peers, bool):
            raise TypeError(f"SyncOptions.wait_peers must be an int, got {type(self.wait_peers).__name__}")
        if self.wait_peers < 0:
            raise ValueError(f"SyncOptions.wait_peers must be >= 0, got {self.wait_peers}")
        if not isinstance(self.blocking, bool):
            raise TypeError(f"SyncOptions.blocking must be a bool, got {type(self.blocking).__name__}")
        for name, positive in (("wait_peers_timeout_s", True), ("wait_peers_report_s", True), ("linger_s", False),
                               ("final_wait_s", False), ("status_period_s", True), ("view_period_s", True),
                               ("serve_s", False), ("max_time_s", False), ("started_at", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SyncOptions.{name} must be a number of seconds, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"SyncOptions.{name} must be a finite number of seconds "
                                 f"{'> 0' if positive else '>= 0'}, got {value}")


@dataclass(frozen=True)
class LearnerOptions:
    """``p2p-diloco join``'s choices for its loop, around its engine's (:class:`SyncOptions`)."""

    name: str
    shard: int | None
    """An explicit data shard (``--shard``), or None: random windows of the whole training split in this
    learner's own order (:func:`p2p_diloco.core.data.stream_seed`)."""
    num_shards: int
    """Shards the training split is dealt into (1 without an explicit shard)."""
    max_steps: int
    """Inner steps this learner runs (the LR schedule still spans ``inner.total_steps``)."""
    sync: SyncOptions = field(default_factory=SyncOptions)
    incarnation: int = 0
    """This start of the learner (wall time in ns): with the peer id, it seeds our data stream, so a peer
    restarted with the same identity does not see the same batches again."""
    lr_by_time: bool = False
    """With ``sync.max_time_s``: the LR's cosine ends when the time does, if that comes before its steps
    (:func:`p2p_diloco.core.inner.schedule_step`)."""
    lr_tokens: int = 0
    """The swarm's tokens at which the LR's cosine ends, if that comes first (``--lr-tokens``: a swarm stopped at a
    token budget anneals by then, as data-parallel training of those tokens does); 0: none."""
    checkpoint_dir: Path | None = None
    """Save checkpoints here (:mod:`p2p_diloco.learner.checkpoint`): every ``checkpoint_every_s`` and when leaving."""
    checkpoint_every_s: float = 0.0
    """Seconds between periodic checkpoints (0: only the final one)."""
    train_nice: int = 5
    """Niceness added to the training thread once it trains (Linux: per thread), so that the swarm's
    communication (the DHT and averager processes) is not starved by inner steps, and to our session's
    autogroup once we have joined (our first committed round), so that a newcomer starting on the same
    machine is not; 0 leaves both as they are."""
    eval_every_s: float = 0.0
    """Seconds between quick held-out evaluations of the anchors while training (``eval`` events; 0: none)."""
    eval_batches: int = QUICK_EVAL_BATCHES
    """Held-out batches per evaluation while training (the first ones of the eval set; at most all of it)."""
    device: str = "cpu"
    """Where the model and the inner optimizer live (``--device``, resolved: ``cpu`` or ``cuda:N``); anchors,
    outer momentum and the outer step stay fp32 on the CPU whatever it is (:mod:`p2p_diloco.core.devices`)."""


def swarm_started(peer_states: Sequence[str]) -> bool:
    """Whether a live learner already trains (or averages): then waiting for peers to start together is moot -- the
    swarm has started without us (e.g. a learner killed while the others waited at the start barrier was replaced by
    one that joined the running swarm, which proposes no start) -- and we join it now."""
    return any(state in ("training", "averaging", "syncing") for state in peer_states)


def wait_verdict(now: float, waited_from: float, started_at: float, max_time_s: float, timeout_s: float) -> str:
    """While waiting for peers (``--wait-peers``): ``"wait"``; ``"max-time"`` once ``max_time_s`` (counted
    from the learner's start ``started_at``; 0: no limit) has run out, so the learner leaves without
    training; ``"timeout"`` once the wait itself has lasted ``timeout_s`` (an error). Monotonic seconds."""
    if max_time_s > 0 and now - started_at >= max_time_s:
        return "max-time"
    if now - waited_from >= timeout_s:
        return "timeout"
    return "wait"


def waiting_line(live: int, needed: int, waited_s: float) -> str:
    """The progress line logged while waiting for peers."""
    return f"waiting for peers: {live} of {needed} live ({waited_s:.0f} s)"


def publish_due(now: float, last_at: float, refresh_s: float, key: tuple[Any, ...], last_key: tuple[Any, ...] | None) -> bool:
    """Whether the status thread publishes our record now: at once when what peers act on (``key``: state,
    fragment versions, anchor hashes) changed since the last publish, else once per ``refresh_s`` (a third of
    the record's TTL) for its counters. Publishing is two DHT stores, each replicated: every status period
    (1 s) it cost each learner's DHT process about 7% of a core on a 2-core machine."""
    return key != last_key or now - last_at >= refresh_s


def published_key(state: str, versions: tuple[int, ...], hashes: tuple[str, ...], training: bool) -> tuple[Any, ...]:
    """What, when it changes, makes the status thread publish our record at once (:func:`publish_due`). While
    training, only the state: the other learners learn our versions from the vouches we sign at each commit
    (the view's head probes, O(1) per read), so a record per commit -- about one a second per learner at
    200 Mbit/s, each a 1.4 KB signed value stored on several nodes -- is not needed; the heartbeat still
    carries them for ``status``. Otherwise (syncing, leaving) the versions too: the last rounds' outcomes
    are what lingering peers wait to agree on."""
    return (state,) if training else (state, versions, hashes)


PEERS_PER_VIEW_PERIOD = 4
"""Full reads of the swarm: one per ``view_period_s`` for every this many live learners (:func:`read_period_s`)."""
MIN_VIEWS_PER_READ = 10
"""...and at most one per this many view periods (30 s, a record's TTL: liveness is no finer), whatever the size."""


def read_period_s(view_period_s: float, live_learners: int) -> float:
    """Seconds between two full reads of the swarm (every live learner's record) while training. A read
    returns every record from every node that holds them, so its bytes grow with the swarm: stretching the
    period in proportion keeps each learner's read bytes per second the same at any size (up to 40 learners:
    10 view periods, 30 s; 64: 16 periods, 48 s). They feed liveness, states and step times (the clock
    leader); what a learner must see quickly -- a peer past its version, the sync clock -- comes from the head
    probe every ``view_period_s`` instead, whose size does not grow."""
    return view_period_s * max(MIN_VIEWS_PER_READ, live_learners / PEERS_PER_VIEW_PERIOD)


def view_due(now: float, last_at: float, period_s: float, training: bool) -> bool:
    """Whether the status thread reads the swarm (and the sync clock) now. Training, once per ``period_s``:
    each read is a DHT search that every node holding the run's records answers with all of them (on a
    4-peer emulated WAN, reads every second were a third of all bytes sent, more than the pseudo-gradients).
    Not training (waiting for peers, lingering until they agree, leaving), at every status tick: those
    waits end on what the view says."""
    return not training or now - last_at >= period_s


def check_supported(cfg: Config) -> None:
    """Refuse config options the networked learner does not implement (checked before joining)."""
    for key, value in (("outer.error_feedback", cfg.outer.error_feedback), ("outer.final_average", cfg.outer.final_average)):
        if value:  # the simulator has them; silently ignoring them would make the runs differ
            raise ValueError(f"{key} = true is not supported by the networked learner yet (simulator only)")


def load_splits(cfg: Config, num_shards: int) -> data.TrainingData:
    """The training data (the byte corpus cut into the held-out split and ``num_shards`` training shards, or a
    streamed dataset), with every check that needs the data (missing, empty, binary, too small, a fingerprint
    or tokenizer other than the run's) done here, before a learner joins (:func:`data.load_training_data`)."""
    return data.load_training_data(cfg, num_shards)


