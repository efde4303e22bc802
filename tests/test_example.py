"""The training example (examples/train.py) on CPU: Hydra composition of the presets, a few steps
through the compose API, exact resumption from a checkpoint, the PNG writer, and a two-process
DistributedDataParallel (gloo) run through torchrun."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train as train_example  # noqa: E402
from data import collate, contact_map, make_proteins  # noqa: E402
from plot import write_png  # noqa: E402

# A few seconds of training: tiny proteins, one block per stack, evaluation and checkpoints every 2 steps.
TINY = [
    "data.n_train=8", "data.n_val=4", "data.min_len=12", "data.max_len=16", "data.n_seq=12",
    "data.msa_depth=6", "data.extra_msa_depth=4", "data.sweeps=2",
    "model.evoformer_stack.no_blocks=1", "model.extra_msa_stack.no_blocks=1",
    "trainer.steps=4", "trainer.batch_size=2", "trainer.warmup_steps=2", "trainer.log_every=2",
    "trainer.eval_every=2", "trainer.ckpt_every=2", "trainer.eval_batch_size=4", "trainer.plot_proteins=2",
    "trainer.min_separations=[4,6]", "trainer.num_threads=1", "backend=eager",
]


def config(*overrides: str):
    train_example.register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def read_png(path: Path) -> torch.Tensor:
    """Decodes the PNGs written by examples/plot.py (8-bit RGB, filter 0) into [H, W, 3] uint8."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body), tag
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = torch.tensor(list(zlib.decompress(chunks[b"IDAT"])), dtype=torch.uint8).view(height, 1 + 3 * width)
    assert torch.all(raw[:, 0] == 0)
    return raw[:, 1:].reshape(height, width, 3)


def test_png_round_trip(tmp_path):
    image = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8)
    write_png(str(tmp_path / "x.png"), image)
    assert torch.equal(read_png(tmp_path / "x.png"), image)


def test_model_presets_come_from_the_library():
    cfg = config("model=af2", "model.evoformer_stack.no_blocks=3")
    stack = cfg.model.evoformer_stack
    assert (stack.c_m, stack.c_z, stack.c_s, stack.no_heads_msa, stack.c_hidden_msa_att) == (256, 128, 384, 8, 32)
    assert stack.no_blocks == 3 and cfg.model.extra_msa_stack.c_m == 64
    small = config().model.evoformer_stack
    assert small.no_blocks == 2 and small.c_m == 32 and config().backend.name == "auto"


def test_synthetic_data_and_batches():
    proteins = make_proteins(
        6, min_len=20, max_len=30, n_seq=10, sweeps=2, coupling=1.0, field=0.5, contact_cutoff=8.0,
        seed=0, interaction_seed=0,
    )
    steps = (proteins.coords[:, 1:] - proteins.coords[:, :-1]).norm(dim=-1)  # [P, L - 1]
    real_steps = proteins.mask[:, 1:] & proteins.mask[:, :-1]
    torch.testing.assert_close(steps[real_steps], torch.full_like(steps[real_steps], 3.8))
    assert torch.all(proteins.msa[~proteins.mask[:, None, :].expand_as(proteins.msa)] == 20)  # padding token
    batch = collate(proteins, torch.tensor([0, 3]), depth=4, generator=torch.Generator().manual_seed(0), extra_depth=3)
    length = int(proteins.lengths[[0, 3]].max())
    assert batch["msa"].shape == (2, 4, length) and batch["extra_msa"].shape == (2, 3, length)
    assert torch.equal(batch["msa"][:, 0], proteins.msa[[0, 3], 0, :length])  # the query row first
    contacts = contact_map(batch["coords"], batch["seq_mask"] > 0, 8.0)
    assert torch.all(contacts.diagonal(dim1=-2, dim2=-1)[batch["seq_mask"] > 0])


def test_train_smoke(tmp_path):
    cfg = config(*TINY, "model.use_extra_msa=true")
    metrics = train_example.train(cfg, str(tmp_path))
    assert {"val_loss", "P@L/5_sep4", "baseline_sep4", "P@L/5_sep6", "baseline_sep6"} <= set(metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert 0 < metrics["baseline_sep4"] < 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [2, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002.pt", "step_000004.pt"]
    image = read_png(tmp_path / "contacts.png")
    assert image.shape[0] > 40 and image.shape[1] > 2 * 40


# The AF3 trunk (MSA module, Pairformer) of the af3_small preset, as tiny as TINY's
TINY_AF3 = [o for o in TINY if not o.startswith("model.")] + [
    "model=af3_small", "model.pairformer_stack.no_blocks=1", "model.msa_module.no_blocks=2",
]


def test_train_smoke_af3_trunk(tmp_path):
    cfg = config(*TINY_AF3)
    assert cfg.model.pairformer_stack.c_s == 32 and "evoformer_stack" not in cfg.model
    metrics = train_example.train(cfg, str(tmp_path))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    state = torch.load(tmp_path / "checkpoints" / "step_000004.pt", weights_only=False)["model"]
    assert any(k.startswith("pairformer.blocks.0.attn_pair_bias.") for k in state)
    assert any(k.startswith("msa_module.blocks.1.tri_att_end.") for k in state)


def test_resume_continues_exactly(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_example.train(config(*TINY), str(full))
    train_example.train(config(*TINY, f"resume={full / 'checkpoints' / 'step_000002.pt'}"), str(resumed))
    a = torch.load(full / "checkpoints" / "step_000004.pt", weights_only=False)
    b = torch.load(resumed / "checkpoints" / "step_000004.pt", weights_only=False)
    assert not (resumed / "checkpoints" / "step_000002.pt").exists()  # it started at step 2
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="no checkpoint"):
        train_example.find_checkpoint(str(tmp_path / "nowhere"))


def test_runs_are_reproducible(tmp_path):
    for name in ("a", "b"):
        train_example.train(config(*TINY, "trainer.steps=2"), str(tmp_path / name))
    a = torch.load(tmp_path / "a" / "checkpoints" / "step_000002.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "checkpoints" / "step_000002.pt", weights_only=False)["model"]
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=0, msg=name)


def test_two_process_ddp_with_gloo(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (gloo) also on a machine with GPUs
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "train.py"), *TINY, f"hydra.run.dir={tmp_path}",
    ]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "world size 2" in log and "done in" in log
    # Rank 0 alone writes the run directory: one log, one metrics file, rank 0's checkpoints.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "checkpoints", "contacts.png", "metrics.jsonl", "train.log"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002.pt", "step_000004.pt"]


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device must not be reached"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"local rank 1 of 2 .* 1 visible CUDA device.*--nproc_per_node=1"):
        train_example.Dist()
