"""The tests of ``tests/unit/test_averaging.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

from pathlib import Path
import pytest
import torch
from test_averaging import ANSWER_STREAMS, ROUND_DEADLINE_S, RecordsTimeouts, SEEN_TIMEOUTS

pytestmark = pytest.mark.integration


def test_the_averager_process_applies_each_rounds_timeouts(tmp_path: Path) -> None:
    from averagers import averaging_swarm, run_round

    from p2p_diloco.averaging.linktime import RoundTimeouts, floor_timeouts
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.waiting import poll_until

    cfg = load_config(None, ["run.run_id=linktime", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"mean\"",
                             "averaging.window_s=1.5", "averaging.next_chunk_timeout_s=2.0",
                             "averaging.allreduce_timeout_s=10.0"])
    names = ("blocks.0.fc.weight", "blocks.1.fc.weight")
    shapes = {n: torch.Size([64, 32]) for n in names}
    derived = RoundTimeouts(request_timeout_s=0.6, sender_timeout_s=7.5, reducer_timeout_s=15.0,
                            allreduce_timeout_s=40.0, matchmaking_slack_s=0.4)
    with averaging_swarm(tmp_path, cfg, names, shapes, (RecordsTimeouts,) * 2) as peers:
        gen = torch.Generator().manual_seed(0)
        tensors = [{n: torch.randn(shapes[n], generator=gen) for n in names} for _ in peers]
        first = run_round(peers, tensors, cfg, (100, 300), ROUND_DEADLINE_S, timeouts=derived)
        assert all(o.committed for o in first), [o.reason for o in first]
        assert tuple(SEEN_TIMEOUTS) == (7.5, 15.0)  # the runner of this round was built with them
        assert all(o.timeouts == derived and o.event()["timeouts"]["sender_timeout_s"] == 7.5 for o in first)
        assert all(o.allreduce_s > 0 and o.rtt_s > 0 for o in first), [(o.allreduce_s, o.rtt_s) for o in first]
        # each reducer answered its sender every part and kept the stream open until the sender, having read them
        # all, closed it -- well before the 15 s linger: a stream the reducer closes can be reset with answers in it
        poll_until(lambda: ANSWER_STREAMS[0] + ANSWER_STREAMS[1] >= 2, 10.0, "both answer streams to end")
        assert tuple(ANSWER_STREAMS) == (2, 0)
        # a round without its own timeouts runs with the config's: nothing sticks from the round before
        second = run_round(peers, tensors, cfg, (100, 300), ROUND_DEADLINE_S)
        assert all(o.committed for o in second), [o.reason for o in second]
        floor = floor_timeouts(cfg.averaging)
        assert tuple(SEEN_TIMEOUTS) == (floor.sender_timeout_s, floor.reducer_timeout_s) == (2.0, 4.0)
        # what the averager process holds once a round's timeouts are applied: every hivemind bound
        held = peers[0].averager.set_round_timeouts(derived).result(timeout=ROUND_DEADLINE_S)
        assert held == {"request_timeout_s": 0.6, "sender_timeout_s": 7.5, "reducer_timeout_s": 15.0,
                        "allreduce_timeout_s": 40.0, "next_chunk_timeout_s": 7.5}

