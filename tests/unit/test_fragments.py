"""Fragments: strided by depth, size-balanced extras, staggered schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from p2p_diloco.core import fragments
from p2p_diloco.core.config import ModelConfig, load_config
from p2p_diloco.core.model import build_model

SIZES = {
    "wte.weight": 300,
    "wpe.weight": 100,
    **{f"blocks.{b}.{p}": 50 for b in range(6) for p in ("attn.weight", "fc.weight")},
    "ln_f.weight": 10,
}


def test_blocks_are_strided_across_depth() -> None:
    groups = fragments.partition(SIZES, 3)
    blocks_of = [sorted({fragments.block_index(n) for n in g if fragments.block_index(n) is not None}) for g in groups]
    assert blocks_of == [[0, 3], [1, 4], [2, 5]]


def test_extras_are_bin_packed_largest_first() -> None:
    groups = fragments.partition(SIZES, 3)
    # every fragment has 200 of block weights; wte (300) -> fragment 0, wpe (100) -> 1, ln_f (10) -> 2
    assert "wte.weight" in groups[0] and "wpe.weight" in groups[1] and "ln_f.weight" in groups[2]
    loads = [sum(SIZES[n] for n in g) for g in groups]
    assert loads == [500, 300, 210]
    assert sorted(n for g in groups for n in g) == sorted(SIZES)  # a partition: each name exactly once


def test_more_fragments_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 6 blocks into 7 fragments"):
        fragments.partition(SIZES, 7)


def test_staggered_schedule() -> None:
    sched = fragments.SyncSchedule(num_fragments=3, sync_every=30)
    due = {s: sched.due(s) for s in range(1, 91)}
    assert [s for s, d in due.items() if d] == [30, 40, 50, 60, 70, 80, 90]
    assert due[30] == [0] and due[40] == [1] and due[50] == [2] and due[60] == [0]
    # before H steps nothing is due: every fragment has at least H steps of local progress
    assert all(not due[s] for s in range(1, 30))
    four = fragments.SyncSchedule(num_fragments=4, sync_every=25)
    assert [s for s in range(1, 51) if four.due(s)] == [25, 32, 38, 44, 50]  # offsets 6.25 apart, rounded up


def test_ramped_schedule_syncs_early_and_then_every_h() -> None:
    sched = fragments.SyncSchedule(num_fragments=1, sync_every=32, start_every=2, ramp_steps=300)
    steps = [s for s in range(1, 1201) if sched.due(s)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert steps[0] <= 3 and gaps[0] <= 3  # H starts at 2 (rounded up as it grows) ...
    assert all(g == 32 for g in gaps[-20:])  # ... and ends at 32
    assert all(b >= a for a, b in zip(gaps, gaps[1:]))  # never shrinks
    # phase closed form = the sum of 1/H(s)
    exact = sum(1 / sched.period(s) for s in range(300))
    assert abs(sched.phase(300) - exact) / exact < 0.02
    assert len(steps) == int(sched.phase(1200) + 1e-9)


def test_schedule_rejects_bad_ramps() -> None:
    with pytest.raises(ValueError):
        fragments.SyncSchedule(num_fragments=2, sync_every=10, start_every=20)


def test_real_model_partition_covers_every_parameter() -> None:
    model = build_model(ModelConfig(), seed=0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    frs = fragments.make_fragments(sizes, 4)
    assert sum(f.numel for f in frs) == sum(sizes.values())
    assert max(f.numel for f in frs) / min(f.numel for f in frs) < 1.25


def test_swarm_step_extrapolates_the_training_peers_steps() -> None:
    # (inner_step, published at DHT time, step time): advanced by the steps taken since publishing
    assert fragments.swarm_step([(300, 100.0, 0.1)], now=101.0) == 310
    assert fragments.swarm_step([(300, 100.0, 0.1)], now=99.0) == 300  # a record "from the future": as is
    # the lower median: one peer's step, not the mean of two groups out of phase
    assert fragments.swarm_step([(100, 0.0, 1.0), (200, 0.0, 1.0)], now=0.0) == 100
    assert fragments.swarm_step([(100, 0.0, 1.0), (150, 0.0, 1.0), (900, 0.0, 1.0)], now=0.0) == 150
    # peers without a measured step time (just started, or starting together with us): nothing to align to
    assert fragments.swarm_step([(2, 0.0, 0.0)], now=5.0) is None
    assert fragments.swarm_step([], now=5.0) is None
    assert fragments.swarm_step([(2, 0.0, 0.0), (40, 0.0, 0.5)], now=1.0) == 42


def due_instants(sched: fragments.SyncSchedule, start_s: float, step_s: float, offset: int, until_s: float
                 ) -> dict[int, list[float]]:
    """Wall instants at which each fragment falls due for a learner that starts at ``start_s`` (its step 0)."""
    out: dict[int, list[float]] = {f: [] for f in range(sched.num_fragments)}
    step = 0
    while start_s + step * step_s < until_s:
        step += 1
        for f in sched.due(step + offset):
            out[f].append(start_s + step * step_s)
    return out


def test_a_newcomer_on_the_step_schedule_falls_due_with_the_swarm() -> None:
    """Issue 17 item 8: a newcomer that counted its due steps from its own first step was due ~4 s after the
    incumbents, every round (the same pace keeps the offset), and met nobody. Numbered from the swarm's
    step (:func:`fragments.swarm_step` of the incumbents' records), it is due when they are."""
    sched = fragments.SyncSchedule(num_fragments=2, sync_every=100)
    step_s, joined_s = 0.1, 37.3  # incumbents started at 0; the newcomer's first step at 37.3 s
    incumbents = due_instants(sched, 0.0, step_s, 0, until_s=120.0)
    # their records, published 0.8 and 2.1 s before the newcomer starts
    records = [(365, 36.5, step_s), (352, 35.2, step_s)]
    at = fragments.swarm_step(records, now=joined_s)
    assert at == 373
    for offset, meets in ((0, False), (at, True)):  # the newcomer's own step count starts at 0
        newcomer = due_instants(sched, joined_s, step_s, offset, until_s=120.0)
        for f, instants in newcomer.items():
            assert instants, f
            gaps = [min(abs(t - u) for u in incumbents[f]) for t in instants]
            # matchmaking forgives about a second (hivemind's min_matchmaking_time is the window, 2 s)
            assert all(g <= step_s + 1e-6 for g in gaps) is meets, (offset, f, gaps)


# ---------------------------------------------------------------- fragments from the model's structure

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config, num_fragments", [("tiny", 1), ("tiny", 2), ("demo", 1), ("demo", 2), ("demo", 4)])
def test_byte_gpt_partition_from_structure_is_the_partition_by_names(config: str, num_fragments: int) -> None:
    """Blocks found by structure give the byte GPT exactly its old fragments (same names, same order)."""
    model = build_model(load_config(ROOT / "configs" / f"{config}.toml").model, seed=0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert fragments.model_fragments(model, num_fragments) == fragments.make_fragments(sizes, num_fragments)


def test_byte_gpt_demo_partition_is_pinned() -> None:
    model = build_model(load_config(ROOT / "configs" / "demo.toml").model, seed=0)
    frs = fragments.model_fragments(model, 4)
    assert [(f.names[0], f.names[-1], len(f.names), f.numel) for f in frs] == [
        ("wte.weight", "blocks.0.fc_out.bias", 13, 231040), ("wpe.weight", "blocks.1.fc_out.bias", 13, 214656),
        ("blocks.2.ln1.weight", "ln_f.bias", 13, 198400), ("blocks.3.ln1.weight", "ln_f.weight", 13, 198400)]


def _hf(model_type: str, **sizes: Any) -> nn.Module:
    """A transformers causal LM on the meta device: its structure, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))


def _llama(layers: int) -> nn.Module:
    return _hf("llama", hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
               vocab_size=512, tie_word_embeddings=False)


def _gpt2(layers: int) -> nn.Module:
    return _hf("gpt2", n_embd=64, n_layer=layers, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0,
               eos_token_id=0)


def _byte_gpt(layers: int) -> nn.Module:
    with torch.device("meta"):
        return build_model(ModelConfig(n_layer=layers), seed=0)


@pytest.mark.parametrize("make, stack", [(_llama, "model.layers"), (_gpt2, "transformer.h"), (_byte_gpt, "blocks")])
@pytest.mark.parametrize("layers, num_fragments", [(4, 2), (8, 4)])
def test_partition_of_real_architectures(make: Callable[[int], nn.Module], stack: str, layers: int,
                                         num_fragments: int) -> None:
    model = make(layers)
    found = fragments.repeated_blocks(model)
    assert found is not None and found[0] == stack and len(found[1]) == layers
    frs = fragments.model_fragments(model, num_fragments)
    names = [n for f in frs for n in f.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # every parameter exactly once
    assert sum(f.numel for f in frs) == sum(p.numel() for p in model.parameters())  # tied tensors counted once
    assert max(f.numel for f in frs) / min(f.numel for f in frs) <= 1.5
    blocks = fragments.block_map(model)
    for f in frs:  # strided by depth: fragment f holds blocks f, f + F, ...
        held = sorted({b for n in f.names if (b := blocks[n]) is not None})
        assert held == list(range(f.index, layers, num_fragments))


def test_tied_embedding_is_one_parameter_in_one_fragment() -> None:
    model = _gpt2(4)
    assert model.lm_head.weight is model.transformer.wte.weight
    frs = fragments.model_fragments(model, 2)
    owners = [f.index for f in frs if "transformer.wte.weight" in f.names]
    assert len(owners) == 1 and not any("lm_head.weight" in f.names for f in frs)


def test_writing_an_anchor_back_keeps_the_tie() -> None:
    """Learners write averaged anchors into ``named_parameters()`` in place: the output head follows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
        tie_word_embeddings=True))
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params
    with torch.no_grad():
        params["model.embed_tokens.weight"].copy_(torch.full_like(params["model.embed_tokens.weight"], 0.25))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, torch.full((64, 16), 0.25))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)])) for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 2)])
        self.out = nn.Linear(8, 10)


def test_the_stack_is_the_module_list_with_the_most_parameters_whatever_its_name() -> None:
    model = _Stack()
    name, stack = fragments.repeated_blocks(model) or ("", nn.ModuleList())
    assert name == "layers" and stack is model.layers
    blocks = fragments.block_map(model)
    assert blocks["layers.2.0.weight"] == 2 and blocks["layers.0.1.0.bias"] == 0
    assert blocks["embed.weight"] is None and blocks["heads.1.weight"] is None
    assert fragments.repeated_blocks(nn.Sequential(nn.Linear(2, 2))) is None
    assert set(fragments.block_map(nn.Linear(2, 2)).values()) == {None}
