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
from evoformer_blocks.ops import backend_names, get_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import ProteinSet, collate, contact_map, make_proteins  # noqa: E402
from plot import contact_figure, contact_panel, write_png  # noqa: E402
from trunk import (  # noqa: E402
    ContactTrunk, bins_below, contact_probability, distance_bins, distogram_loss, top_l_precision,
)

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
# Checks before any work


PRECISIONS = ("auto", "bf16", "fp32")  # trainer.precision


class ConfigError(ValueError):
    """A setting that makes the run impossible or meaningless, found before any work is done; on the
    command line the message is all that is printed (no traceback)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def check_config(cfg: DictConfig, cuda_available: bool) -> None:
    """Raises :class:`ConfigError` listing every setting of ``cfg`` that makes the run fail or mean
    nothing (a step count below 1, an MSA deeper than the sampled one, ``backend=cutlass`` without a
    CUDA GPU, ...), before any data are made or any model is built."""
    t, d, model = cfg.trainer, cfg.data, cfg.model
    problems = []

    def need(ok: bool, key: str, value, rule: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r} {rule}")

    for section, node, keys in (
        ("trainer", t, ("steps", "batch_size", "log_every", "eval_every", "ckpt_every", "eval_batch_size")),
        ("data", d, ("n_train", "n_val", "min_len", "max_len", "n_seq", "msa_depth", "sweeps")),
        ("model", model, ("no_bins", "relpos_k")),
    ):
        for key in keys:
            need(_is_int(node[key]) and node[key] >= 1, f"{section}.{key}", node[key], "must be an int >= 1")
    for key in ("warmup_steps", "plot_proteins"):
        need(_is_int(t[key]) and t[key] >= 0, f"trainer.{key}", t[key], "must be an int >= 0")
    need(_is_int(d.extra_msa_depth) and d.extra_msa_depth >= (1 if model.use_extra_msa else 0),
         "data.extra_msa_depth", d.extra_msa_depth,
         "must be an int >= 1 with model.use_extra_msa" if model.use_extra_msa else "must be an int >= 0")
    need(t.eval_chunk_size is None or (_is_int(t.eval_chunk_size) and t.eval_chunk_size >= 1),
         "trainer.eval_chunk_size", t.eval_chunk_size, "must be null or an int >= 1")
    need(t.num_threads is None or (_is_int(t.num_threads) and t.num_threads >= 1),
         "trainer.num_threads", t.num_threads, "must be null or an int >= 1")
    need(_is_number(t.lr) and t.lr > 0, "trainer.lr", t.lr, "must be a positive number")
    need(_is_number(t.grad_clip) and t.grad_clip > 0, "trainer.grad_clip", t.grad_clip, "must be a positive number")
    need(_is_number(t.weight_decay) and t.weight_decay >= 0, "trainer.weight_decay", t.weight_decay, "must be a number >= 0")
    need(t.precision in PRECISIONS, "trainer.precision", t.precision, "must be auto, bf16 or fp32")
    need(isinstance(t.compile, bool), "trainer.compile", t.compile, "must be true or false")
    need(t.cuda_graphs in ("auto", True, False), "trainer.cuda_graphs", t.cuda_graphs, "must be auto, true or false")
    if t.cuda_graphs is True:
        reason = graphs_unavailable(cfg, cuda_available)
        need(reason is None, "trainer.cuda_graphs", True, f"cannot serve: {reason}")
    for key in ("contact_cutoff", "coupling"):
        need(_is_number(d[key]) and d[key] > 0, f"data.{key}", d[key], "must be a positive number")
    need(_is_number(d.field) and d.field >= 0, "data.field", d.field, "must be a number >= 0")
    if not problems:  # the relations between settings, once each is valid on its own
        need(d.max_len >= d.min_len, "data.max_len", d.max_len, f"must be >= data.min_len={d.min_len}")
        extra = d.extra_msa_depth if model.use_extra_msa else 0
        need(d.msa_depth + extra <= d.n_seq, "data.msa_depth", d.msa_depth,
             f"plus the extra MSA's {extra} rows must be at most the {d.n_seq} sampled sequences (data.n_seq)")
        seps = t.min_separations
        need(OmegaConf.is_list(seps) and len(seps) > 0 and all(_is_int(s) and 1 <= s < d.max_len for s in seps),
             "trainer.min_separations", list(seps) if OmegaConf.is_list(seps) else seps,
             f"must be a non-empty list of ints from 1 to data.max_len - 1 = {d.max_len - 1}")
        if _is_number(model.first_break) and _is_number(model.last_break) and 0 < model.first_break < model.last_break:
            try:
                bins_below(distance_bins(model.first_break, model.last_break, model.no_bins), d.contact_cutoff)
            except ValueError as exc:
                problems.append(f"data.contact_cutoff={d.contact_cutoff!r}: {exc} (model.first_break, last_break, no_bins)")
        else:
            problems.append(
                f"model.first_break={model.first_break!r}, model.last_break={model.last_break!r} must be numbers "
                "with 0 < first_break < last_break"
            )
    name = cfg.backend.name
    if name not in backend_names():
        problems.append(f"backend.name={name!r} must be one of {backend_names()}")
    elif name == "cutlass":
        caps = get_backend("cutlass").capabilities
        if not cuda_available:
            problems.append(
                "backend=cutlass runs only on a CUDA GPU and none is visible here: use backend=auto (cutlass "
                "where it can run, else eager) or backend=eager"
            )
        elif caps.min_compute_capability and torch.cuda.get_device_capability() < caps.min_compute_capability:
            have, want = torch.cuda.get_device_capability(), caps.min_compute_capability
            problems.append(
                f"backend=cutlass needs compute capability {want[0]}.{want[1]} or newer and this GPU has "
                f"{have[0]}.{have[1]}: use backend=auto or backend=eager"
            )
    if problems:
        raise ConfigError("; ".join(problems))


def cpu_threads(num_threads: Optional[int], cores: int, processes: int) -> int:
    """The threads of each of ``processes`` CPU processes on ``cores`` cores: ``num_threads``, at most
    the cores per process (more threads than cores only compete); None: all the cores per process."""
    per_process = max(1, cores // processes)
    return per_process if num_threads is None else min(num_threads, per_process)


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
                raise ConfigError(
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
    raise ConfigError(f"resume={path!r}: no checkpoint file there and no step_*.pt in it or its checkpoints/")


def _flat(node, prefix: str) -> dict:
    """A nested config as ``{"model.evoformer_stack.c_m": 32, ...}``."""
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}.{key}").items()}


def load_checkpoint(path: Path, model, cfg: DictConfig, device: torch.device) -> dict:
    """The checkpoint at ``path``, its weights loaded into ``model``. Raises :class:`ConfigError`
    where they do not fit the model of this config, saying which model settings differ (from the
    config saved in the checkpoint) and how many tensors, with an example, instead of every key."""
    state = torch.load(path, map_location=device, weights_only=False)
    have, want = state["model"], model.state_dict()
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    reshaped = [k for k in want if k in have and have[k].shape != want[k].shape]
    if missing or unexpected or reshaped:
        saved = _flat(state.get("config", {}).get("model", {}), "model")
        current = _flat(OmegaConf.to_container(cfg.model, resolve=True), "model")
        differ = [
            f"{k} is {saved.get(k, '(not set)')} there and {current.get(k, '(not set)')} here"
            for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)
        ]
        counts = [
            f"{len(keys)} {what} (e.g. {example(keys[0])})"
            for keys, what, example in (
                (missing, "of this model's tensors not in the checkpoint", str),
                (unexpected, "of the checkpoint's tensors not in this model", str),
                (reshaped, "tensors of another shape",
                 lambda k: f"{k}: {list(have[k].shape)} there, {list(want[k].shape)} here"),
            )
            if keys
        ]
        settings = f"model settings that differ: {', '.join(differ)}" if differ else "no model setting differs"
        raise ConfigError(
            f"resume={cfg.resume}: the checkpoint {path} holds another model than this config builds; {settings}; "
            f"{'; '.join(counts)}. Resume with the checkpoint's model settings (its run's .hydra/config.yaml)"
        )
    model.load_state_dict(have)
    return state


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


def graphs_unavailable(cfg: DictConfig, cuda_available: bool) -> Optional[str]:
    """Why the stacks' CUDA graphs cannot serve this run, or None."""
    if not cuda_available:
        return "no CUDA GPU is visible"
    if cfg.backend.name == "eager":
        return "backend=eager (graphs replay the fused kernels)"
    if cfg.trainer.compile:
        return "trainer.compile=true (torch.compile runs the stacks itself)"
    return None


def use_cuda_graphs(cfg: DictConfig, device: torch.device) -> bool:
    """trainer.cuda_graphs resolved for this run (auto: wherever they can serve)."""
    if cfg.trainer.cuda_graphs == "auto":
        return graphs_unavailable(cfg, device.type == "cuda") is None
    return bool(cfg.trainer.cuda_graphs)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def autocast_context(device: torch.device, precision: str):
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision must be auto, bf16 or fp32, got {precision!r}")
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
    pad_to = cfg.data.max_len if use_cuda_graphs(cfg, device) else None
    for start in range(0, len(proteins), cfg.trainer.eval_batch_size):
        index = torch.arange(start, min(start + cfg.trainer.eval_batch_size, len(proteins)))
        batch = to_device(collate(proteins, index, cfg.data.msa_depth, generator, extra, pad_to), device)
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
    panels, titles = [], []
    for k, (probs, contacts) in enumerate(kept):
        n = probs.shape[0]
        i, j = torch.triu_indices(n, n, offset=min_separation)
        top = torch.zeros(n, n, dtype=torch.bool)
        if i.numel():
            best = probs[i, j].topk(min(max(1, n // 5), i.numel())).indices
            top[i[best], j[best]] = True
        panels.append(contact_panel(probs, contacts, top))
        titles.append(f"held-out protein {k + 1} (L = {n})")
    write_png(str(path), contact_figure(panels, titles, min_separation))


# ----------------------------------------------------------------------------------------------
# Training


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Trains as configured, writing logs, metrics, checkpoints and the figure under ``run_dir``
    (rank 0 only). Returns the final held-out metrics (on every rank)."""
    t_start = time.perf_counter()
    check_config(cfg, torch.cuda.is_available())
    ctx = Dist()
    run_dir = Path(run_dir)
    if ctx.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    t = cfg.trainer
    if ctx.device.type == "cpu":
        torch.set_num_threads(cpu_threads(t.num_threads, os.cpu_count() or 1, ctx.local_world))
    graphs = use_cuda_graphs(cfg, ctx.device)
    if ctx.main:
        log.info(
            "device %s | world size %d | backend %s | precision %s | threads %d | CUDA graphs %s | run dir %s",
            ctx.device, ctx.world, cfg.backend.name, t.precision, torch.get_num_threads(),
            "on" if graphs else "off", run_dir,
        )

    # Model (and the checkpoint it resumes from) before the data, so that a model that does not fit
    # fails in seconds. The same initial weights on every process (DDP also broadcasts rank 0's).
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
        cuda_graphs=graphs,
    ).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    start_step = 0
    if cfg.resume:
        path = find_checkpoint(cfg.resume)
        state = load_checkpoint(path, model, cfg, ctx.device)
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        if ctx.main:
            log.info("resumed from %s at step %d", path, start_step)
    if ctx.main:
        log.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)

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
        batch = to_device(collate(train_set, index, d.msa_depth, generator, extra, d.max_len if graphs else None), ctx.device)
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
    if ctx.main:  # what this run wrote: nothing where a resumed run had no step left to train
        written = [name for name in ("contacts.png", "metrics.jsonl", "checkpoints/") if (run_dir / name).exists()]
        log.info(
            "done in %.1fs | held-out top-L/5 contact precision: %s | %s", time.perf_counter() - t_start,
            headline(metrics), f"{', '.join(written)} in {run_dir}" if written else "no files written",
        )
    ctx.barrier()
    ctx.close()
    return metrics


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as exc:  # the message says it all: no traceback through Hydra
        raise SystemExit(f"examples/train.py: {exc}") from None


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
