"""The public API's refusals of issue 49 around a joined swarm (no network): each bad call fails at once with one
clear line, before it touches shared state."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco import build_model
from p2p_diloco.core.config import Config
from test_engine import cfg, engine  # noqa: F401  (cfg: a fixture)


def test_start_after_close_is_a_clear_error(cfg: Config) -> None:  # noqa: F811
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        d.close()
        with pytest.raises(RuntimeError, match=r"^DiLoCo.start after finish\(\) or close\(\)"):
            d.start()
        assert not d.view._thread.is_alive()  # nothing was started
