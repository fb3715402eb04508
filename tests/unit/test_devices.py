"""Devices and precision (issue 19, part 3), on a CPU: ``--device`` resolution (pure), the refusal of a CUDA
device this machine lacks, the fp32 CPU path unchanged, bf16 autocast on the CPU, and the host/device
boundary (anchors and outer state fp32 on the CPU, whatever the model computes in)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from scripts_loader import load_script
from p2p_diloco.core import data, devices
from p2p_diloco.sim import simulator as sim
from p2p_diloco.core.config import ConfigError, load_config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.identity import inner_identity
from p2p_diloco.core.devices import load_into, resolve_device, to_host
from p2p_diloco.core.inner import AdamW, build_optimizer, lr_at, train_step
from p2p_diloco.core.model import build_model, lm_loss

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _splits(shards: int) -> data.Splits:
    """Our own source code as bytes (learnable text, no dependency on the corpus loader), cut like a corpus."""
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "p2p_diloco").rglob("*.py")))[:600_000]
    stream = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    held = len(stream) // 20
    size = (len(stream) - held) // shards
    return data.Splits(eval=stream[:held], shards=tuple(stream[held + i * size:held + (i + 1) * size]
                                                        for i in range(shards)))


# ---------------------------------------------------------------- --device (pure)


@pytest.mark.parametrize("spec, available, count, expected", [
    ("auto", False, 0, "cpu"),
    ("auto", True, 2, "cuda:0"),
    ("cpu", True, 2, "cpu"),
    ("cuda", True, 1, "cuda:0"),
    ("cuda:1", True, 2, "cuda:1"),
    ("CUDA:0", True, 1, "cuda:0"),
    ("auto", False, 3, "cpu"),  # a count without availability (a broken driver) is no device
])
def test_resolve_device(spec: str, available: bool, count: int, expected: str) -> None:
    assert resolve_device(spec, available, count) == torch.device(expected)


def test_resolve_device_refusals_are_one_line_naming_the_flag() -> None:
    with pytest.raises(ValueError) as e:
        resolve_device("cuda", False, 0, "2.13.0+cpu", cuda_build=False)
    assert str(e.value) == ("--device cuda: no CUDA device on this machine (torch 2.13.0+cpu is a CPU build); "
                            "use --device cpu")
    with pytest.raises(ValueError, match=r"^--device cuda:0: no CUDA device on this machine \(torch 2.13.0\+cu128 "
                                         r"sees none\); use --device cpu$"):
        resolve_device("cuda:0", False, 0, "2.13.0+cu128", cuda_build=True)
    with pytest.raises(ValueError, match=r"^--device cuda:2: this machine has 2 CUDA devices \(cuda:0 .. cuda:1\)$"):
        resolve_device("cuda:2", True, 2)
    with pytest.raises(ValueError, match=r"^--device cuda:1: this machine has 1 CUDA device \(cuda:0\)$"):
        resolve_device("cuda:1", True, 1)
    for bad in ("gpu", "cpu:0", "auto:1", "cuda:-1", "cuda:", ""):
        with pytest.raises(ValueError, match=r"^--device .*: expected auto, cpu, cuda or cuda:N$"):
            resolve_device(bad, True, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [
    ["sim", "--device", "cuda", "--config", "configs/tiny.toml"],
    ["join", "--device", "cuda", "--config", "configs/tiny.toml",
     "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"],
])
def test_device_cuda_without_one_is_one_line_exit_2_nothing_left(command: list[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.main", *command], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out == "", (out, err)
    assert err == (f"p2p-diloco: error: --device cuda: no CUDA device on this machine (torch {torch.__version__} "
                   "is a CPU build); use --device cpu\n"), err
    with pytest.raises(ProcessLookupError):  # nothing of its session is left running
        os.killpg(proc.pid, 0)


def test_machine_device_auto_is_this_machine() -> None:
    assert devices.machine_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert devices.machine_device("cpu") == CPU


# ---------------------------------------------------------------- inner.precision in the config


def test_precision_is_validated_and_hashed_only_when_not_fp32() -> None:
    fp32 = load_config(ROOT / "configs" / "tiny.toml")
    assert fp32.inner.precision == "fp32" and "precision" not in inner_identity(fp32.inner)
    explicit = load_config(ROOT / "configs" / "tiny.toml", ["inner.precision=fp32"])
    assert config_hash(explicit) == config_hash(fp32)  # runs from before the key existed keep their hash
    bf16 = load_config(ROOT / "configs" / "tiny.toml", ["inner.precision=bf16"])
    assert config_hash(bf16) != config_hash(fp32)  # bf16 changes the training: peers must agree on it
    with pytest.raises(ConfigError, match=r"^inner.precision: must be one of fp32, bf16, got 'fp16'$"):
        load_config(ROOT / "configs" / "tiny.toml", ["inner.precision=fp16"])
    assert tomllib.loads((ROOT / "configs" / "llama-20m.toml").read_text())["inner"]["precision"] == "bf16"  # the GPU example


def test_check_precision() -> None:
    devices.check_precision("fp32", CPU)
    devices.check_precision("bf16", CPU)  # CPU autocast: allowed (slower than fp32 without bf16 units)
    with pytest.raises(ValueError, match="inner.precision"):
        devices.check_precision("fp8", CPU)


# ---------------------------------------------------------------- the fp32 CPU path is unchanged


def test_fp32_cpu_step_is_the_plain_loop_bit_for_bit() -> None:
    """train_step on the CPU in fp32 (what every learner did before devices existed) is exactly a plain
    loop: no autocast, the batch untouched, our AdamW."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["model.n_layer=2", "model.n_embd=32", "model.block_size=16"])
    assert isinstance(devices.autocast(CPU, "fp32"), contextlib.nullcontext)  # fp32 enters no autocast at all
    a, b = build_model(cfg.model, 0), build_model(cfg.model, 0)
    opt_a = build_optimizer(a, cfg.inner, CPU)
    opt_b = AdamW(b.parameters(), lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                  weight_decay=cfg.inner.weight_decay)
    assert type(opt_a) is AdamW
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        y = torch.randint(0, 256, (2, 16), generator=gen)
        loss_a = train_step(a, opt_a, (x, y), step, 10, cfg.inner, CPU)
        for group in opt_b.param_groups:
            group["lr"] = lr_at(step, 10, cfg.inner.warmup_steps, cfg.inner.lr, cfg.inner.min_lr_ratio)
        loss = lm_loss(b, x, y)
        opt_b.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(b.parameters(), cfg.inner.grad_clip)
        opt_b.step()
        assert loss_a == float(loss.detach())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_cuda_optimizer_path_is_torch_fused_adamw() -> None:
    """On CUDA the inner optimizer is torch's fused AdamW: built here on CPU parameters (torch's fused kernel
    runs on CPUs too), it takes the same steps as ours up to rounding."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["model.n_layer=2", "model.n_embd=32", "model.block_size=16"])
    ours, fused = build_model(cfg.model, 0), build_model(cfg.model, 0)
    opt_ours = build_optimizer(ours, cfg.inner, CPU)
    opt_fused = build_optimizer(fused, cfg.inner, torch.device("cuda"))
    assert isinstance(opt_fused, torch.optim.AdamW) and opt_fused.defaults["fused"] is True
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    for step in range(3):
        train_step(ours, opt_ours, (x, x), step, 10, cfg.inner, CPU)
        train_step(fused, opt_fused, (x, x), step, 10, cfg.inner, CPU)  # the CPU copy of the batch: it is here
    for (name, a), b in zip(ours.named_parameters(), fused.parameters()):
        # atol: one step moves a weight by about lr (3e-3 here); Adam's m / (sqrt(v) + eps) on a near-zero gradient
        # rounds differently in the fused kernel (the qkv biases differed by 1.05e-6 on an AMD EPYC, < 1e-6 elsewhere)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # its state moves between devices like ours: what a checkpoint stores and a restore loads
    p = next(fused.parameters())
    host = devices.state_to_host(opt_fused.state[p])
    assert all(t.device.type == "cpu" for t in host.values()) and host["step"].dtype == torch.float32
    back = devices.state_to_device(host, CPU)
    assert all(torch.equal(back[k], opt_fused.state[p][k]) for k in back)


# ---------------------------------------------------------------- the host/device boundary


def test_to_host_copies_and_load_into_writes_back() -> None:
    model = build_model(load_config(ROOT / "configs" / "tiny.toml").model, 0)
    params = dict(model.named_parameters())
    host = to_host(params, ["wte.weight"])
    assert list(host) == ["wte.weight"] and host["wte.weight"].dtype == torch.float32
    assert host["wte.weight"].data_ptr() != params["wte.weight"].data_ptr()  # never an alias, even on the CPU
    assert not host["wte.weight"].requires_grad
    host["wte.weight"].add_(1.0)
    assert not torch.equal(host["wte.weight"], params["wte.weight"])
    load_into(params, host)
    assert torch.equal(params["wte.weight"], host["wte.weight"])
    assert model.lm_head.weight is model.wte.weight  # tying survives the copy back


# ---------------------------------------------------------------- bf16 autocast on the CPU


@pytest.mark.parametrize("config", ["tiny.toml", "llama-tiny.toml"])
def test_bf16_autocast_runs_on_cpu_and_weights_stay_fp32(config: str) -> None:
    """The forward pass computes in bf16 (the logits are bf16), the loss and every weight, gradient and AdamW
    moment stay fp32: mixed precision, for the byte GPT and the HF Llama."""
    cfg = load_config(ROOT / "configs" / config, ["inner.precision=bf16"])
    model = build_model(cfg.model, 0)
    opt = build_optimizer(model, cfg.inner, CPU)
    seen: list[torch.dtype] = []
    head = model.lm_head
    hook = head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    x = torch.randint(0, 256, (2, cfg.model.block_size), generator=torch.Generator().manual_seed(3))
    loss = train_step(model, opt, (x, x), 0, 10, cfg.inner, CPU)
    hook.remove()
    assert seen == [torch.bfloat16] and loss == loss  # computed in bf16, finite
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert all(t.dtype == torch.float32 for t in opt.state[p].values()), name


def test_bf16_sim_on_cpu_learns_and_keeps_fp32_anchors_on_the_cpu() -> None:
    """A short bf16 simulation on the CPU: the anchors' loss falls, and the anchors and outer momenta are fp32
    CPU tensors (the outer step never sees bf16)."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "inner.precision=bf16", "sim.learners=2", "inner.total_steps=30", "inner.warmup_steps=3",
        "outer.sync_every=5", "model.n_layer=2", "data.eval_batches=2"])
    torch.set_num_threads(1)
    s = sim.Simulator(cfg, _splits(2), eval_points=2, device=CPU)
    r = s.run()
    assert r.rounds > 0 and r.final_eval_loss < r.curve[0]["eval_loss"] - 0.5, r.curve
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in s.anchor.values())
    momenta = [t for state in s.outer_states for t in state.momentum.values()]
    assert momenta and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in momenta)
    assert all(p.dtype == torch.float32 for m in s.learners for p in m.params.values())


def test_sim_on_an_explicit_cpu_device_is_the_default_sim_bit_for_bit() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "sim.learners=2", "inner.total_steps=8", "inner.warmup_steps=2", "outer.sync_every=4", "model.n_layer=2",
        "data.eval_batches=1"])
    torch.set_num_threads(1)
    splits = _splits(2)
    default, explicit = sim.Simulator(cfg, splits, eval_points=1), sim.Simulator(cfg, splits, eval_points=1, device=CPU)
    a, b = default.run(), explicit.run()
    assert a.final_eval_loss == b.final_eval_loss
    assert all(torch.equal(default.anchor[n], explicit.anchor[n]) for n in default.anchor)


# ---------------------------------------------------------------- the networked learner's loop, without a network


def _bench_module() -> Any:
    """scripts/bench_overhead.py: its network-less learner (averagers that commit at once) drives the real loop."""
    return load_script("bench_overhead.py", "bench_overhead")


def test_bf16_learner_keeps_anchors_and_momenta_fp32_on_the_cpu_and_checkpoints_on_the_host(tmp_path: Path) -> None:
    """Learner.train_once in bf16 on the CPU, rounds committing: the anchors and outer momenta stay fp32 CPU
    tensors, the weights fp32; a checkpoint holds host tensors and restores bit for bit into a new learner."""
    bench = _bench_module()
    cfg = bench.bench_config(True, "bf16")
    batches = bench.make_batches(cfg, 4)
    step, unit = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events.jsonl")
    for _ in range(22):  # H = 10 over 2 fragments: each is due at least once, and applied a step later
        step()
    assert all(s.committed >= 1 and s.version >= 1 for s in unit.slots)
    for s in unit.slots:
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in s.anchor.values())
        assert s.state.momentum and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                        for t in s.state.momentum.values())
    assert all(p.dtype == torch.float32 for p in unit.params.values())
    tensors, meta = unit.checkpoint_state()
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert any(k.startswith("adam/") for k in tensors) and meta["model_digest"] == unit._model_digest()
    _, other = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events-2.jsonl")
    ckpt = SimpleNamespace(path=tmp_path, manifest=meta, tensors=tensors)
    assert other.restore(ckpt) == meta["model_digest"]
    assert [s.anchor_hash for s in other.slots] == [s.anchor_hash for s in unit.slots]
    p = next(iter(unit.params.values()))
    q = next(iter(other.params.values()))
    assert all(torch.equal(unit.opt.state[p][k], other.opt.state[q][k]) for k in unit.opt.state[p])
    unit.close()
    other.close()
