"""When a learner's status thread publishes its record (pure decision, no DHT)."""

from __future__ import annotations

import math

from p2p_diloco.learner import publish_due, view_due

KEY = ("training", (3, 2, 2, 1), ("a", "b", "c", "d"))


def test_first_publish_is_due() -> None:
    assert publish_due(0.0, -math.inf, 3.3, KEY, None)


def test_unchanged_record_waits_for_its_refresh() -> None:
    assert not publish_due(101.0, 100.0, 3.3, KEY, KEY)
    assert not publish_due(103.2, 100.0, 3.3, KEY, KEY)
    assert publish_due(103.4, 100.0, 3.3, KEY, KEY)


def test_what_peers_act_on_goes_out_at_once() -> None:
    moved_on = ("training", (4, 2, 2, 1), ("e", "b", "c", "d"))  # a round committed: peers check if they are behind
    leaving = ("leaving", KEY[1], KEY[2])
    assert publish_due(100.5, 100.0, 3.3, moved_on, KEY)
    assert publish_due(100.5, 100.0, 3.3, leaving, KEY)


def test_view_is_read_every_period_while_training() -> None:
    assert view_due(0.0, -math.inf, 3.0, training=True)
    assert not view_due(102.9, 100.0, 3.0, training=True)
    assert view_due(103.0, 100.0, 3.0, training=True)


def test_view_is_read_at_every_tick_when_not_training() -> None:
    # waiting for peers and lingering until they agree end on what the view says
    assert view_due(100.1, 100.0, 3.0, training=False)
