"""A downloaded state is checked against what other peers signed, not only against the hash its donor
declares (issue 21, the threat model's first gap): a member that claims a newer version and serves a
fabricated anchor -- with a hash that matches it -- is refused (``unvouched``) and the next donor is used.

Real hivemind DHTs and fragment averagers on 127.0.0.1 (in-process hosts, averager processes forked)."""

from __future__ import annotations

from typing import Any

import torch

from p2p_diloco.averaging.decisions import vouchers
from p2p_diloco.core.config import load_config

NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(2))
SHAPES = {n: torch.Size([16, 8]) for n in NAMES}
DEADLINE_S = 90.0
CFG = load_config(None, ["run.run_id=vouch", "model.n_layer=2", "outer.fragments=2", "outer.codec=\"fp32\"",
                         "averaging.state_timeout_s=10.0"])
HONEST = {n: torch.full(SHAPES[n], 0.5 + i) for i, n in enumerate(NAMES)}
FAKE = {n: torch.full(SHAPES[n], 1000.0) for n in NAMES}  # consistent with its own hash: only a vouch tells
MOMENTUM = {n: torch.zeros(SHAPES[n]) for n in NAMES}


def test_vouchers_are_the_signers_of_exactly_that_anchor() -> None:
    signed: dict[str, Any] = {"A": "a" * 16, "B": "a" * 16, "C": "b" * 16, "D": 7}
    assert vouchers(signed, "a" * 16) == {"A", "B"}
    assert vouchers(signed, "b" * 16) - {"C"} == set()  # the donor alone vouching for itself: refused
    assert vouchers({}, "a" * 16) == set()
