"""Real fragment averagers for in-process tests: one hivemind DHT + one :class:`FragmentAveragerHost` per
runner class on 127.0.0.1, joined to the first one, all shut down on exit."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch


@contextlib.contextmanager
def averaging_swarm(tmp_path: Path, cfg: Any, names: Sequence[str], shapes: Mapping[str, torch.Size],
                    runners: Sequence[type], providers: Sequence[Callable[[], Any] | None] | None = None,
                    ) -> Iterator[list[Any]]:
    """``providers``: per peer, the state it serves to downloads (None: it shares none)."""
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.averaging.host import FragmentAveragerHost
    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.membership import SwarmOptions, start_dht, visible_addresses

    dhts: list[Any] = []
    peers: list[Any] = []
    try:
        for i, runner in enumerate(runners):
            identity = load_or_create_identity(tmp_path / f"peer{i}.id")  # libp2p id = record-signing key
            key = identity.private_key()
            initial = parse_initial_peers(visible_addresses(dhts[0])[:1]) if dhts else ()
            opts = SwarmOptions(initial_peers=initial, identity=identity, check_identity_free=False)
            dhts.append(start_dht(opts, cfg.run.run_id, private_key=key))
            peers.append(FragmentAveragerHost(cfg, 0, names, shapes, dhts[-1], key, runner_class=runner,
                                              state_provider=providers[i] if providers else None))
        yield peers
    finally:
        for p in peers:
            p.shutdown()
        for d in dhts:
            d.shutdown()


def run_round(peers: Sequence[Any], tensors: Sequence[Mapping[str, torch.Tensor]], cfg: Any, tokens: Sequence[int],
              deadline_s: float, timeouts: Any = None, links: Sequence[float] | None = None) -> list[Any]:
    """One round of fragment 0 at version 0 among ``peers``, peer i bringing ``tensors[i]`` and ``tokens[i]``
    tokens (its weight) and ``links[i]`` (its measured link in bytes per second; None: none measured), all scheduled
    one window from now, with ``timeouts`` (a :class:`RoundTimeouts`; None: the config's); returns every peer's
    :class:`RoundOutcome`."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.sync.fragment import Contribution

    start = get_dht_time() + cfg.averaging.window_s
    futures = []
    for peer, t, n, link in zip(peers, tensors, tokens, links or [0.0] * len(peers), strict=True):
        contribution = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=n, steps=10, weight=float(n),
                                    tensors=dict(t), norms={})
        plan = RoundPlan(start, cfg.averaging.window_s, due=get_dht_time(), timeouts=timeouts, link_Bps=link)
        futures.append(peer.start_round(contribution, plan))
    return [f.result(timeout=deadline_s) for f in futures]
