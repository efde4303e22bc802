"""Model-size presets as ``ml_collections.ConfigDict``.

Library classes take plain arguments; a preset only gathers them, and
:func:`build_from_config` (behind ``EvoformerStack.from_config``) turns one into a module::

    from evoformer_blocks import EvoformerStack
    from evoformer_blocks.config import get_config

    cfg = get_config("af2")
    cfg.evoformer_stack.no_blocks = 8              # edit before building
    stack = EvoformerStack.from_config(cfg, backend="eager")

An AF2 preset has the sections ``evoformer_stack`` and ``extra_msa_stack`` (the keyword arguments
of :class:`~evoformer_blocks.EvoformerStack` and :class:`~evoformer_blocks.ExtraMSAStack`) and the
shared widths ``c_m``, ``c_z``, ``c_s``, ``c_e`` at the top: the sections refer to them, so setting
``cfg.c_z = 64`` changes both stacks. An AF3 preset has ``pairformer_stack`` and ``msa_module``
(:class:`~evoformer_blocks.PairformerStack`, :class:`~evoformer_blocks.MSAModule`) and ``c_s``,
``c_z``, ``c_m``. Attention widths ``c_hidden_*`` are per head.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Any

import ml_collections

PRESETS = ("af2", "small", "af3", "af3_small")
logger = logging.getLogger("evoformer_blocks")


# What the checkpointed blocks recompute (evoformer_blocks.recompute): each stack as before by default
_RECOMPUTE = dict(recompute=None, recompute_budget_gib=None, checkpoint_last_group=True)


def _preset(
    c_m: int,
    c_z: int,
    c_s: int,
    c_e: int,
    evoformer: dict,
    extra_msa: dict,
    dropout: tuple[float, float] = (0.15, 0.25),
    blocks_per_ckpt=None,
) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict()
    cfg.c_m, cfg.c_z, cfg.c_s, cfg.c_e = c_m, c_z, c_s, c_e
    msa_dropout, pair_dropout = dropout
    common = dict(
        c_z=cfg.get_ref("c_z"),
        transition_n=4,
        msa_dropout=msa_dropout,
        pair_dropout=pair_dropout,
        blocks_per_ckpt=blocks_per_ckpt,
        **_RECOMPUTE,
        inf=1e9,
        eps_opm=1e-3,
    )
    cfg.evoformer_stack = ml_collections.ConfigDict(
        dict(common, c_m=cfg.get_ref("c_m"), c_s=cfg.get_ref("c_s"), **evoformer)
    )
    cfg.extra_msa_stack = ml_collections.ConfigDict(dict(common, c_m=cfg.get_ref("c_e"), eps=1e-10, **extra_msa))
    return cfg


def _af3_preset(
    c_s: int, c_z: int, c_m: int, pairformer: dict, msa_module: dict, dropout: tuple[float, float] = (0.15, 0.25),
    blocks_per_ckpt=None,
) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict()
    cfg.c_s, cfg.c_z, cfg.c_m = c_s, c_z, c_m
    msa_dropout, pair_dropout = dropout
    common = dict(
        c_z=cfg.get_ref("c_z"), transition_n=4, pair_dropout=pair_dropout, blocks_per_ckpt=blocks_per_ckpt,
        **_RECOMPUTE, inf=1e9,
    )
    cfg.pairformer_stack = ml_collections.ConfigDict(dict(common, c_s=cfg.get_ref("c_s"), **pairformer))
    cfg.msa_module = ml_collections.ConfigDict(
        dict(common, c_m=cfg.get_ref("c_m"), msa_dropout=msa_dropout, eps_opm=1e-3, **msa_module)
    )
    return cfg


def get_config(name: str) -> ml_collections.ConfigDict:
    """Returns a fresh preset.

    * ``"af2"``: AlphaFold 2 (supplement 1.5-1.6, Algorithms 6 and 18): c_m 256, c_z 128, c_s 384;
      48 Evoformer blocks, MSA attention 8 heads × 32, triangle attention 4 heads × 32, transitions
      ×4, outer product mean 32, triangle multiplication 128, dropout 0.15 (MSA row attention) and
      0.25 (pair); extra MSA c_e 64, 4 blocks, MSA attention 8 heads × 8. ``blocks_per_ckpt`` 1
      (as trained; checkpointing only acts while gradients are enabled). Every stack section of
      every preset also holds ``recompute`` None, ``recompute_budget_gib`` None and
      ``checkpoint_last_group`` True (full recomputation, see :mod:`evoformer_blocks.recompute`).
    * ``"small"``: the same architecture shrunk for CPU examples and tests: c_m 32, c_z 32, c_s 32,
      2 blocks, 4 heads × 8 in every attention (8 is the head width the fused kernel needs a
      multiple of), outer product mean 8, triangle multiplication 32, no dropout; extra MSA c_e 16,
      1 block, triangle multiplication 16.
    * ``"af3"``: AlphaFold 3's trunk (supplement Algorithms 8 and 17): sections ``pairformer_stack``
      (:class:`~evoformer_blocks.PairformerStack`: c_s 384, c_z 128, 48 blocks, attention with pair
      bias 16 heads × 24, triangle attention 4 heads × 32, triangle multiplication 128, transitions
      ×4, dropout 0.25) and ``msa_module`` (:class:`~evoformer_blocks.MSAModule`: c_m 64, 4 blocks,
      pair-weighted averaging 8 heads × 8, outer product mean 32, dropout 0.15 and 0.25);
      ``blocks_per_ckpt`` 1.
    * ``"af3_small"``: the same shrunk for CPU examples and tests: c_s 32, c_z 32, c_m 16, 2
      Pairformer blocks and 1 MSA-module block, heads of 8 channels, no dropout.
    """
    if name == "af2":
        return _preset(
            c_m=256,
            c_z=128,
            c_s=384,
            c_e=64,
            evoformer=dict(
                c_hidden_msa_att=32, c_hidden_opm=32, c_hidden_mul=128, c_hidden_pair_att=32,
                no_heads_msa=8, no_heads_pair=4, no_blocks=48,
            ),
            extra_msa=dict(
                c_hidden_msa_att=8, c_hidden_opm=32, c_hidden_mul=128, c_hidden_pair_att=32,
                no_heads_msa=8, no_heads_pair=4, no_blocks=4,
            ),
            blocks_per_ckpt=1,
        )
    if name == "small":
        return _preset(
            c_m=32,
            c_z=32,
            c_s=32,
            c_e=16,
            evoformer=dict(
                c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=32, c_hidden_pair_att=8,
                no_heads_msa=4, no_heads_pair=4, no_blocks=2,
            ),
            extra_msa=dict(
                c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
                no_heads_msa=4, no_heads_pair=4, no_blocks=1,
            ),
            dropout=(0.0, 0.0),
        )
    if name == "af3":
        return _af3_preset(
            c_s=384, c_z=128, c_m=64,
            pairformer=dict(
                c_hidden_pair_bias=24, no_heads_pair_bias=16, c_hidden_mul=128, c_hidden_pair_att=32, no_heads_pair=4,
                no_blocks=48,
            ),
            msa_module=dict(
                c_hidden_msa_att=8, c_hidden_opm=32, c_hidden_mul=128, c_hidden_pair_att=32, no_heads_msa=8,
                no_heads_pair=4, no_blocks=4,
            ),
            blocks_per_ckpt=1,
        )
    if name == "af3_small":
        return _af3_preset(
            c_s=32, c_z=32, c_m=16,
            pairformer=dict(
                c_hidden_pair_bias=8, no_heads_pair_bias=4, c_hidden_mul=32, c_hidden_pair_att=8, no_heads_pair=4,
                no_blocks=2,
            ),
            msa_module=dict(
                c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8, no_heads_msa=4,
                no_heads_pair=4, no_blocks=1,
            ),
            dropout=(0.0, 0.0),
        )
    raise ValueError(f"get_config: unknown `name` {name!r}; choose one of {list(PRESETS)}")


def _as_dict(owner: str, cfg: Any) -> dict:
    """A ``ConfigDict``, an OmegaConf ``DictConfig`` (Hydra) or a mapping as a plain dict."""
    if isinstance(cfg, ml_collections.ConfigDict):
        return cfg.to_dict()
    # OmegaConf comes with the example's extra (hydra-core): a DictConfig exists only if it is imported.
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(cfg, omegaconf.DictConfig):
        return omegaconf.OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise ValueError(f"{owner}.from_config: `cfg` must be a ConfigDict, DictConfig or mapping, got {type(cfg).__name__}")


def build_from_config(cls, cfg: Any, section: str, overrides: dict):
    """``cls(**arguments)`` from a config: a mapping (``ConfigDict``, ``DictConfig``, dict) of the
    constructor's arguments, or a whole preset that holds them under ``section`` (or under
    ``cls.openfold_config_section``, where the class names one: OpenFold's name of the section);
    ``overrides`` win over the config. Keys named in ``cls.openfold_ignored_keys`` (where the class
    has it) are dropped, the list logged; ``cls._openfold_arguments`` (where it has it) translates
    the rest of an OpenFold section. Unknown or missing arguments raise ``ValueError`` naming them."""
    owner = cls.__name__
    arguments = _as_dict(owner, cfg)
    openfold_section = getattr(cls, "openfold_config_section", None)
    if section in arguments:
        arguments = _as_dict(owner, arguments[section])
    elif openfold_section is not None and openfold_section in arguments:
        arguments = _as_dict(owner, arguments[openfold_section])
    arguments.update(overrides)
    ignored = getattr(cls, "openfold_ignored_keys", {})
    dropped = sorted(key for key in arguments if key in ignored)
    if dropped:
        logger.info(
            "%s.from_config: ignored the OpenFold keys %s (%s)", owner, dropped,
            "; ".join(f"{key}: {ignored[key]}" for key in dropped),
        )
        arguments = {key: value for key, value in arguments.items() if key not in ignored}
    translate = getattr(cls, "_openfold_arguments", None)
    if translate is not None:
        arguments = translate(arguments)
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise ValueError(f"{owner}.from_config: `cfg` has unknown keys {unknown}; accepted: {accepted}")
    missing = [p for p in accepted if params[p].default is inspect.Parameter.empty and p not in arguments]
    if missing:
        raise ValueError(f"{owner}.from_config: `cfg` lacks the required keys {missing}")
    return cls(**arguments)
