"""Train a small AlphaFold-style trunk to predict contacts from co-evolution, end to end.

Synthetic proteins (examples/data.py) carry their contacts only in the co-evolution of their MSA;
the trunk (examples/trunk.py: embeddings → EvoformerStack → distogram head) learns to read them.
Reported: the top-L/5 contact precision at ``|i - j| >= 12`` and ``>= 24`` on held-out proteins,
next to the random baseline (the contact density of those pairs).

    python examples/train.py                              # CPU: a few minutes, eager backend
    python examples/train.py trainer.steps=2000 model.evoformer_stack.no_blocks=4
    python examples/train.py model=af2 backend=cutlass    # GPU: cutlass kernels, bf16 autocast
    python examples/train.py model=af3_small              # AF3's trunk: MSA module and Pairformer (CPU)
    python examples/train.py model=af3 backend=cutlass    # AF3's sizes (GPU)
    torchrun --nproc_per_node=2 examples/train.py         # DistributedDataParallel (gloo on CPU)
    python examples/train.py resume=outputs/<date>/<time>  # continue from that run's newest checkpoint

A resumed run with the same settings continues exactly where the checkpoint left off (batches and
dropout masks are functions of the seed and the step); a larger ``trainer.steps`` trains on with
the learning-rate schedule stretched to the new length.

Outputs go to Hydra's run directory: ``train.log``, ``metrics.jsonl``, ``checkpoints/``,
``contacts.png`` (held-out proteins: predicted above the diagonal, true contacts below).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

try:
    import hydra
except ModuleNotFoundError as exc:  # Hydra comes with the example's extra, not with the library
    raise SystemExit('examples/train.py needs Hydra: pip install -e ".[example]"') from exc
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

try:
    import evoformer_blocks  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evoformer_blocks.config import PRESETS, get_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import ProteinSet, collate, contact_map, make_proteins  # noqa: E402
from plot import contact_figure, contact_panel, write_png  # noqa: E402
from trunk import ContactTrunk, contact_probability, distance_bins, distogram_loss, top_l_precision  # noqa: E402

log = logging.getLogger("train")
# The presets' sections the trunk takes (AF2: evoformer_stack, extra_msa_stack; AF3: msa_module,
# pairformer_stack)
TRUNK_SECTIONS = ("evoformer_stack", "extra_msa_stack", "msa_module", "pairformer_stack")


def register_configs() -> None:
    """Registers each preset of :func:`evoformer_blocks.config.get_config` as the Hydra config
    ``model/<name>_preset``, so configs/model/*.yaml take the stack sizes from the library's
    presets (one source of truth) and every value stays overridable."""
    store = ConfigStore.instance()
    for name in PRESETS:
        preset = get_config(name)
        node = {key: preset[key].to_dict() for key in TRUNK_SECTIONS if key in preset}
        store.store(group="model", name=f"{name}_preset", node=node)


# ----------------------------------------------------------------------------------------------
# Distributed setup


class Dist:
    """The process's place in a ``torchrun`` job (a single process without one)."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            if self.local_rank >= gpus:
                raise ValueError(
                    f"local rank {self.local_rank} of {self.local_world} processes on this node has no GPU: the node "
                    f"has {gpus} visible CUDA device(s) and each process trains on its own. Start at most {gpus} "
                    f"per node (torchrun --nproc_per_node={gpus}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to "
                    "train on the CPU with gloo."
                )
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, value: float) -> float:
        """The mean of ``value`` over all processes."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Progress, metrics, checkpoints


class Progress:
    """One log line per call: ``step 150/600 [#####...............]  25% | ... | eta 1m52s``."""

    def __init__(self, total: int, start: int = 0, width: int = 20) -> None:
        self.total, self.start, self.width = total, start, width
        self.t0 = time.perf_counter()

    def line(self, step: int, **values: float) -> str:
        done = step / max(1, self.total)
        bar = "#" * round(done * self.width)
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        fields = " | ".join(f"{k} {v:.4g}" for k, v in values.items())
        return (
            f"step {step}/{self.total} [{bar:<{self.width}}] {100 * done:3.0f}% | {fields} | "
            f"{rate:.2f} step/s | eta {int(eta // 60)}m{int(eta % 60):02d}s"
        )


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 10% of ``lr`` at ``steps``."""
    t = cfg.trainer
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def find_checkpoint(path: str) -> Path:
    """``path`` itself, or the newest ``step_*.pt`` in ``path`` or ``path/checkpoints``."""
    p = Path(hydra.utils.to_absolute_path(path))
    if p.is_file():
        return p
    for folder in (p / "checkpoints", p):
        found = sorted(folder.glob("step_*.pt")) if folder.is_dir() else []
        if found:
            return found[-1]
    raise ValueError(f"resume={path!r}: no checkpoint file there and no step_*.pt in it or its checkpoints/")


def save_checkpoint(path: Path, model, optimizer, step: int, cfg: DictConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # never leave a half-written checkpoint under the final name


# ----------------------------------------------------------------------------------------------
# Evaluation


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def autocast_context(device: torch.device, precision: str):
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"trainer.precision must be auto, bf16 or fp32, got {precision!r}")
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def run_model(model, batch: dict, chunk_size: Optional[int] = None) -> torch.Tensor:
    return model(
        batch["msa"], batch["msa_mask"], batch["pair_mask"], batch.get("extra_msa"), batch.get("extra_msa_mask"),
        chunk_size=chunk_size,
    )


@torch.no_grad()
def evaluate(model, proteins: ProteinSet, cfg: DictConfig, device, edges, keep: int = 0):
    """Held-out loss and top-L/5 precisions (with their random baselines); also returns the
    contact probabilities and true contacts of the first ``keep`` proteins for the figure."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(0)  # the same MSA rows at every evaluation
    losses, precision, baseline, kept = [], {}, {}, []
    extra = cfg.data.extra_msa_depth if cfg.model.use_extra_msa else 0
    for start in range(0, len(proteins), cfg.trainer.eval_batch_size):
        index = torch.arange(start, min(start + cfg.trainer.eval_batch_size, len(proteins)))
        batch = to_device(collate(proteins, index, cfg.data.msa_depth, generator, extra), device)
        with autocast_context(device, cfg.trainer.precision):
            logits = run_model(model, batch, cfg.trainer.eval_chunk_size)
        losses.append(distogram_loss(logits, batch["coords"], batch["pair_mask"], edges).item() * len(index))
        probs = contact_probability(logits, edges, cfg.data.contact_cutoff)  # [B, L, L]
        contacts = contact_map(batch["coords"], batch["seq_mask"] > 0, cfg.data.contact_cutoff)
        for sep in cfg.trainer.min_separations:
            p, d = top_l_precision(probs, contacts, batch["lengths"], sep)
            precision.setdefault(sep, []).extend(p)
            baseline.setdefault(sep, []).extend(d)
        for b in range(len(index)):
            if len(kept) < keep:
                n = int(batch["lengths"][b])
                kept.append((probs[b, :n, :n].cpu(), contacts[b, :n, :n].cpu()))
    model.train(was_training)
    metrics = {"val_loss": sum(losses) / len(proteins)}
    for sep in cfg.trainer.min_separations:
        metrics[f"P@L/5_sep{sep}"] = sum(precision[sep]) / max(1, len(precision[sep]))
        metrics[f"baseline_sep{sep}"] = sum(baseline[sep]) / max(1, len(baseline[sep]))
    return metrics, kept


def draw_contacts(path: Path, kept, min_separation: int) -> None:
    panels = []
    for probs, contacts in kept:
        n = probs.shape[0]
        i, j = torch.triu_indices(n, n, offset=min_separation)
        top = torch.zeros(n, n, dtype=torch.bool)
        if i.numel():
            best = probs[i, j].topk(min(max(1, n // 5), i.numel())).indices
            top[i[best], j[best]] = True
        panels.append(contact_panel(probs, contacts, top))
    write_png(str(path), contact_figure(panels))


# ----------------------------------------------------------------------------------------------
# Training


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Trains as configured, writing logs, metrics, checkpoints and the figure under ``run_dir``
    (rank 0 only). Returns the final held-out metrics (on every rank)."""
    t_start = time.perf_counter()
    ctx = Dist()
    run_dir = Path(run_dir)
    if ctx.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    t = cfg.trainer
    if ctx.device.type == "cpu":
        torch.set_num_threads(t.num_threads or max(1, (os.cpu_count() or 1) // ctx.local_world))
    if ctx.main:
        log.info(
            "device %s | world size %d | backend %s | precision %s | threads %d | run dir %s",
            ctx.device, ctx.world, cfg.backend.name, t.precision, torch.get_num_threads(), run_dir,
        )

    # Data: every process builds the same proteins from the seeds and draws its own batches.
    d = cfg.data
    extra = d.extra_msa_depth if cfg.model.use_extra_msa else 0
    common = dict(
        min_len=d.min_len, max_len=d.max_len, n_seq=d.n_seq, sweeps=d.sweeps, coupling=d.coupling,
        field=d.field, contact_cutoff=d.contact_cutoff, interaction_seed=d.interaction_seed,
    )
    t0 = time.perf_counter()
    train_set = make_proteins(d.n_train, seed=d.seed, **common)
    val_set = make_proteins(d.n_val, seed=d.seed + 1, **common)
    if ctx.main:
        log.info(
            "data: %d training and %d held-out proteins, length %d-%d, %d sequences each (%.1fs)",
            d.n_train, d.n_val, d.min_len, d.max_len, d.n_seq, time.perf_counter() - t0,
        )

    # Model: the same initial weights on every process (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    edges = distance_bins(cfg.model.first_break, cfg.model.last_break, cfg.model.no_bins).to(ctx.device)
    sections = {key: OmegaConf.to_container(cfg.model[key], resolve=True) for key in TRUNK_SECTIONS if key in cfg.model}
    if not cfg.model.use_extra_msa:
        sections.pop("extra_msa_stack", None)
    model = ContactTrunk(
        **sections,
        no_bins=cfg.model.no_bins,
        relpos_k=cfg.model.relpos_k,
        backend=cfg.backend.name,
    ).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    start_step = 0
    if cfg.resume:
        path = find_checkpoint(cfg.resume)
        state = torch.load(path, map_location=ctx.device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        if ctx.main:
            log.info("resumed from %s at step %d", path, start_step)
    if ctx.main:
        log.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    net = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None) if ctx.world > 1 else model
    if t.compile:
        net = torch.compile(net)

    metrics_path = run_dir / "metrics.jsonl"

    def record(entry: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def headline(metrics: dict) -> str:
        return " | ".join(
            f"P@L/5 |i-j|>={s}: {metrics[f'P@L/5_sep{s}']:.3f} (random {metrics[f'baseline_sep{s}']:.3f})"
            for s in t.min_separations
        )

    progress = Progress(t.steps, start_step)
    running, seen = 0.0, 0
    metrics: dict = {}
    net.train()
    for step in range(start_step, t.steps):
        # Batches and dropout masks are functions of (seed, step, rank): a resumed run continues
        # exactly where the checkpoint left off.
        seed = (cfg.seed * 1_000_003 + step) * ctx.world + ctx.rank
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        index = torch.randint(len(train_set), (t.batch_size,), generator=generator)
        batch = to_device(collate(train_set, index, d.msa_depth, generator, extra), ctx.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast_context(ctx.device, t.precision):
            logits = run_model(net, batch)
        loss = distogram_loss(logits, batch["coords"], batch["pair_mask"], edges)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        running += loss.item()
        seen += 1
        done = step + 1

        if done % t.log_every == 0 or done == t.steps:
            train_loss = ctx.mean(running / seen)
            running, seen = 0.0, 0
            if ctx.main:
                log.info(progress.line(done, loss=train_loss, lr=lr_at(step, cfg)))
                record({"step": done, "train_loss": train_loss, "lr": lr_at(step, cfg), "time": time.perf_counter() - t_start})
        if done % t.eval_every == 0 or done == t.steps:
            if ctx.main:
                metrics, kept = evaluate(model, val_set, cfg, ctx.device, edges, keep=t.plot_proteins if done == t.steps else 0)
                log.info("eval step %d | val loss %.4f | %s", done, metrics["val_loss"], headline(metrics))
                record({"step": done, **metrics})
                if done == t.steps and kept:
                    draw_contacts(run_dir / "contacts.png", kept, t.min_separations[0])
            ctx.barrier()
        if ctx.main and (done % t.ckpt_every == 0 or done == t.steps):
            save_checkpoint(run_dir / "checkpoints" / f"step_{done:06d}.pt", model, optimizer, done, cfg)

    if start_step >= t.steps and ctx.main:  # nothing left to train: report the checkpoint's model
        metrics, _ = evaluate(model, val_set, cfg, ctx.device, edges)
    if ctx.main:
        log.info(
            "done in %.1fs | held-out top-L/5 contact precision: %s | contacts.png, metrics.jsonl and "
            "checkpoints/ in %s", time.perf_counter() - t_start, headline(metrics), run_dir,
        )
    ctx.barrier()
    ctx.close()
    return metrics


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg, HydraConfig.get().runtime.output_dir)


def _other_ranks_write_nothing() -> None:
    """Under torchrun, only rank 0 owns Hydra's run directory: the other ranks get a scratch run
    directory, no saved config and no log file (they log nothing; rank 0 logs and saves)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0:
        sys.argv = [a for a in sys.argv if not a.startswith("hydra.run.dir=")] + [
            f"hydra.run.dir={tempfile.gettempdir()}/evoformer_blocks_train_rank{rank}",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ]


if __name__ == "__main__":
    register_configs()
    _other_ranks_write_nothing()
    main()
