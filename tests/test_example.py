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
from plot import FONT, colour_bar, contact_figure, contact_panel, probability_colour, text_image, text_mask, write_png  # noqa: E402

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


def occurrences(image: torch.Tensor, pattern: torch.Tensor) -> int:
    """How many times ``pattern`` ([h, w, 3] uint8) appears in ``image`` pixel for pixel: its inkiest
    row is searched for in every image row as bytes, and each hit compared whole."""
    (h, w, _), (height, width, _) = pattern.shape, image.shape
    key = int((pattern != 255).any(-1).sum(-1).argmax())  # the row with the most non-white pixels
    needle = bytes(pattern[key].flatten().tolist())
    found = 0
    for y in range(height - h + 1):
        row = bytes(image[y + key].flatten().tolist())
        at = row.find(needle)
        while at != -1:
            x = at // 3
            if at % 3 == 0 and x + w <= width and torch.equal(image[y : y + h, x : x + w], pattern):
                found += 1
            at = row.find(needle, at + 1)
    return found


def test_font():
    assert torch.equal(text_mask("1"), FONT["1"]) and FONT["1"].shape == (9, 5)
    assert text_mask("ij").shape == (9, 11) and not text_mask("ij")[:, 5].any()  # one blank column between
    assert text_image("P", vertical=True).shape == (5, 9, 3)
    with pytest.raises(ValueError, match=r"no glyph for \['#'\]"):
        text_mask("#1")


def test_contact_figure_is_labelled():
    gen = torch.Generator().manual_seed(0)
    panels = []
    for n in (20, 33):
        probs = torch.rand(n, n, generator=gen)
        contacts = torch.rand(n, n, generator=gen) < 0.2
        top = torch.zeros(n, n, dtype=torch.bool)
        top[0, 10] = top[1, 12] = True
        panels.append(contact_panel(probs, contacts, top))
    image = contact_figure(panels, ["first (L = 20)", "second (L = 33)"], min_separation=6)
    for text, count in [("residue j", 2), ("first (L = 20)", 1), ("second (L = 33)", 1), ("P(contact)", 2),
                        ("above the diagonal: predicted P(contact); below: true contacts", 1),
                        ("top-L/5 predicted pair with |i - j| >= 6: a true contact", 1),
                        ("true contact (below the diagonal)", 1), ("30", 2)]:
        assert occurrences(image, text_image(text)) == count, text
    assert occurrences(image, text_image("held-out contact maps", scale=2)) == 1
    assert occurrences(image, text_image("residue i", vertical=True)) == 2
    # the colour bar, 33 * 4 pixels high, is the colour map from 1 at the top to 0 at the bottom
    bar = colour_bar(33 * 4)
    assert occurrences(image, bar) == 1
    column = torch.nonzero((bar == torch.tensor([0, 51, 140], dtype=torch.uint8)).all(-1))  # P = 1: its top row
    row, col = column[0].tolist()
    expected = probability_colour(torch.linspace(1, 0, 33 * 4)).round().to(torch.uint8)
    assert torch.equal(bar[row : row + 33 * 4, col], expected)


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
    assert occurrences(image, text_image("residue j")) == 2 and occurrences(image, text_image("P(contact)")) == 2
    assert occurrences(image, text_image("top-L/5 predicted pair with |i - j| >= 4: not a contact")) == 1


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


# name -> (overrides, what the message must say)
BAD_CONFIGS = {
    "no steps": (["trainer.steps=-1"], r"trainer.steps=-1 must be an int >= 1"),
    "zero steps": (["trainer.steps=0"], r"trainer.steps=0 must be an int >= 1"),
    "log_every 0": (["trainer.log_every=0"], r"trainer.log_every=0 must be an int >= 1"),
    "batch 0": (["trainer.batch_size=0"], r"trainer.batch_size=0"),
    "negative lr": (["trainer.lr=-0.1"], r"trainer.lr=-0.1 must be a positive number"),
    "precision": (["trainer.precision=fp8"], r"trainer.precision='fp8' must be auto, bf16 or fp32"),
    "threads 0": (["trainer.num_threads=0"], r"trainer.num_threads=0 must be null or an int >= 1"),
    "threads word": (["trainer.num_threads=all"], r"trainer.num_threads='all' must be null or an int >= 1"),
    "two problems": (["trainer.steps=0", "data.n_train=0"], r"trainer.steps=0 .*; data.n_train=0"),
    "lengths": (["data.min_len=40", "data.max_len=30"], r"data.max_len=30 must be >= data.min_len=40"),
    "MSA deeper than sampled": (["data.msa_depth=100"], r"data.msa_depth=100 .* at most the 96 sampled"),
    "separation past the length": (["trainer.min_separations=[12,64]"], r"trainer.min_separations=\[12, 64\]"),
    "no separation": (["trainer.min_separations=[]"], r"trainer.min_separations=\[\]"),
    "separation not a list": (["trainer.min_separations=12"], r"trainer.min_separations=12 must be a non-empty list"),
    "cutoff off the bins": (["data.contact_cutoff=7.5"], r"data.contact_cutoff=7.5: .* bin edge"),
    "unknown backend": (["backend.name=fast"], r"backend.name='fast' must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_refused_before_any_work(case, tmp_path, monkeypatch):
    overrides, message = BAD_CONFIGS[case]
    monkeypatch.setattr(train_example, "make_proteins", lambda *a, **k: pytest.fail("data made for a bad config"))
    monkeypatch.setattr(train_example, "ContactTrunk", lambda *a, **k: pytest.fail("model built for a bad config"))
    with pytest.raises(train_example.ConfigError, match=message):
        train_example.train(config(*overrides), str(tmp_path))


def test_cutlass_without_a_gpu_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train_example, "make_proteins", lambda *a, **k: pytest.fail("data made for a bad config"))
    with pytest.raises(train_example.ConfigError, match="backend=cutlass runs only on a CUDA GPU and none is visible"):
        train_example.train(config("backend=cutlass"), str(tmp_path))
    train_example.check_config(config("backend=auto"), cuda_available=False)  # auto and eager run anywhere
    train_example.check_config(config("backend=eager"), cuda_available=False)


@pytest.mark.parametrize(
    "override, message",
    [("trainer.steps=-1", "trainer.steps=-1 must be an int >= 1"), ("backend=cutlass", "backend=cutlass runs only on a CUDA GPU")],
)
def test_command_line_prints_a_bad_config_in_one_line(tmp_path, override, message):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, also on a machine with one
    command = [sys.executable, str(ROOT / "examples" / "train.py"), override, f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()  # one line on stderr: the message
    assert line.startswith(f"examples/train.py: {message}")
    assert "Traceback" not in result.stdout + result.stderr and "Error executing job" not in result.stderr
    assert "data:" not in (tmp_path / "train.log").read_text()  # refused before the data were made


def test_resume_with_another_model_size_says_which(tmp_path):
    train_example.train(config(*TINY, "trainer.steps=2"), str(tmp_path / "a"))
    with pytest.raises(train_example.ConfigError) as info:
        train_example.train(config(*TINY, "model.evoformer_stack.c_m=16", f"resume={tmp_path / 'a'}"), str(tmp_path / "b"))
    message = str(info.value)
    assert "model.evoformer_stack.c_m is 32 there and 16 here" in message
    assert "tensors of another shape (e.g. " in message and len(message) < 800, message


def test_done_line_names_only_the_files_written(tmp_path, caplog):
    caplog.set_level("INFO", logger="train")
    train_example.train(config(*TINY, "trainer.steps=2"), str(tmp_path / "a"))
    assert f"contacts.png, metrics.jsonl, checkpoints/ in {tmp_path / 'a'}" in caplog.records[-1].getMessage()
    # Resumed at its last step: nothing left to train, nothing written (it used to list all three)
    train_example.train(config(*TINY, "trainer.steps=2", f"resume={tmp_path / 'a'}"), str(tmp_path / "b"))
    assert caplog.records[-1].getMessage().endswith("| no files written")
    assert not (tmp_path / "b" / "contacts.png").exists()


def test_cpu_threads():
    assert config().trainer.num_threads == 4  # a bound by default, not every core
    assert train_example.cpu_threads(4, cores=128, processes=1) == 4
    assert train_example.cpu_threads(4, cores=2, processes=1) == 2  # never more threads than cores
    assert train_example.cpu_threads(4, cores=8, processes=4) == 2
    assert train_example.cpu_threads(None, cores=128, processes=2) == 64  # null: all the cores
    assert train_example.cpu_threads(None, cores=1, processes=2) == 1


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


def test_batches_padded_to_one_length():
    proteins = make_proteins(
        5, min_len=10, max_len=20, n_seq=6, sweeps=1, coupling=1.0, field=0.5, contact_cutoff=8.0,
        seed=1, interaction_seed=0,
    )
    gen = torch.Generator().manual_seed(0)
    for index in (torch.tensor([0, 1]), torch.tensor([2, 3, 4])):
        batch = collate(proteins, index, depth=3, generator=gen, extra_depth=2, pad_to=20)
        assert batch["msa"].shape[-1] == 20 and batch["pair_mask"].shape[-2:] == (20, 20)
        lengths = proteins.lengths[index]
        beyond = torch.arange(20)[None, :] >= lengths[:, None]  # [B, 20]: the padding
        assert torch.all(batch["seq_mask"][beyond] == 0) and torch.all(batch["seq_mask"][~beyond] == 1)
        assert torch.all(batch["msa_mask"].transpose(1, 2)[beyond] == 0)
    with pytest.raises(ValueError, match="pad_to=25 must lie between"):
        collate(proteins, torch.tensor([0]), depth=3, generator=gen, pad_to=25)


def test_cuda_graphs_setting(monkeypatch):
    cpu = torch.device("cpu")
    assert not train_example.use_cuda_graphs(config(), cpu)  # auto: off without a GPU
    train_example.check_config(config("trainer.cuda_graphs=false"), cuda_available=False)
    with pytest.raises(train_example.ConfigError, match="trainer.cuda_graphs=True cannot serve: no CUDA GPU"):
        train_example.check_config(config("trainer.cuda_graphs=true"), cuda_available=False)
    with pytest.raises(train_example.ConfigError, match="cannot serve: backend=eager"):
        train_example.check_config(config("trainer.cuda_graphs=true", "backend=eager"), cuda_available=True)
    with pytest.raises(train_example.ConfigError, match="trainer.cuda_graphs='yes' must be auto, true or false"):
        train_example.check_config(config("trainer.cuda_graphs=yes"), cuda_available=False)
    gpu = torch.device("cuda", 0)
    assert train_example.use_cuda_graphs(config(), gpu)
    assert not train_example.use_cuda_graphs(config("trainer.compile=true"), gpu)
    assert not train_example.use_cuda_graphs(config("backend=eager"), gpu)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU of compute capability >= 8.0")
def test_train_on_gpu_replays_cuda_graphs(tmp_path, caplog):
    """On a GPU the example trains with the stacks' CUDA graphs by default (batches padded to one
    length); its losses follow a run without graphs."""
    gpu = [o for o in TINY if o != "backend=eager"] + ["backend=auto", "trainer.steps=6", "model.use_extra_msa=true"]
    with caplog.at_level("INFO"):
        with_graphs = train_example.train(config(*gpu), str(tmp_path / "graphs"))
    assert "CUDA graphs on" in caplog.text
    assert "cuda_graphs: EvoformerStack: captured the training step" in caplog.text
    assert "cuda_graphs: ExtraMSAStack: captured the training step" in caplog.text
    assert "running without graphs" not in caplog.text
    without = train_example.train(config(*gpu, "trainer.cuda_graphs=false"), str(tmp_path / "plain"))
    assert all(torch.isfinite(torch.tensor(v)) for v in with_graphs.values())
    assert abs(with_graphs["val_loss"] - without["val_loss"]) <= 0.03 * abs(without["val_loss"])
