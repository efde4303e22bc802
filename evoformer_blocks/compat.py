"""Loading OpenFold weights: parameter-name correspondence as data, plus one loader.

Each of our module classes has a :class:`Converter` in a table (:data:`CONVERTERS`). A converter
names the OpenFold class it corresponds to and lists, as plain data,

* ``tensors``: OpenFold parameter name -> our parameter name, for tensors the module holds itself;
* ``children``: OpenFold submodule path -> our submodule path; the tensors below are renamed by the
  child's own converter. A pair of paths ending in ``.*`` stands for every entry of an
  ``nn.ModuleList``/``nn.Sequential`` (index ``i`` on both sides);
* ``same_names``: the module's own tensors keep their names (leaf modules such as
  ``nn.LayerNorm`` and ``nn.Linear``, whose OpenFold counterparts name them alike).

To support a new class (e.g. an Evoformer block), register its converter with
:func:`register_converter`, typically as ``children`` pointing at the attention modules here::

    register_converter(MyBlock, Converter(
        "openfold.model.evoformer.EvoformerBlock",
        children={"msa_att_row": "msa_att_row", "core.tri_att_start": "tri_att_start"},
    ))

:func:`load_openfold_state_dict` loads an OpenFold-named state_dict into one of our modules,
refusing missing, unexpected and mis-shaped tensors; :func:`to_openfold_state_dict` goes the other
way; :func:`openfold_key_map` gives the name correspondence itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Mapping, NamedTuple

import torch
from torch import nn

from .attention import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from .evoformer import EvoformerBlock, EvoformerStack, ExtraMSABlock, ExtraMSAStack
from .outer_product_mean import OuterProductMean
from .transitions import MSATransition, PairTransition
from .triangle_multiplication import (
    FusedTriangleMultiplicationIncoming,
    FusedTriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__all__ = [
    "Converter",
    "CONVERTERS",
    "register_converter",
    "openfold_key_map",
    "load_openfold_state_dict",
    "to_openfold_state_dict",
    "LoadResult",
]


@dataclass(frozen=True)
class Converter:
    """How one of our module classes maps onto an OpenFold class (see the module docstring)."""

    openfold_class: str
    children: Mapping[str, str] = field(default_factory=dict)  # OpenFold submodule path -> ours
    tensors: Mapping[str, str] = field(default_factory=dict)  # OpenFold tensor name -> ours
    same_names: bool = False  # the module's own tensors keep their names


CONVERTERS: dict[type, Converter] = {}


def register_converter(cls: type, converter: Converter) -> None:
    """Adds (or replaces) the converter of ``cls``; subclasses of ``cls`` use it too."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"register_converter: `cls` must be an nn.Module subclass, got {cls!r}")
    if not isinstance(converter, Converter):
        raise ValueError(f"register_converter: `converter` must be a Converter, got {type(converter).__name__}")
    CONVERTERS[cls] = converter


def _gated_attention(openfold_prefix: str) -> dict[str, str]:
    """OpenFold's ``Attention``/``GlobalAttention`` projections under ``openfold_prefix`` -> ours."""
    return {f"{openfold_prefix}{name}": name for name in ("linear_q", "linear_k", "linear_v", "linear_g", "linear_o")}


register_converter(nn.LayerNorm, Converter("openfold.model.primitives.LayerNorm", same_names=True))
register_converter(nn.Linear, Converter("openfold.model.primitives.Linear", same_names=True))
register_converter(
    MSARowAttentionWithPairBias,
    Converter(
        "openfold.model.msa.MSARowAttentionWithPairBias",
        children={
            "layer_norm_m": "layer_norm_m",
            "layer_norm_z": "layer_norm_z",
            "linear_z": "linear_z",
            **_gated_attention("mha."),
        },
    ),
)
register_converter(
    MSAColumnAttention,
    Converter(
        "openfold.model.msa.MSAColumnAttention",
        children={"_msa_att.layer_norm_m": "layer_norm_m", **_gated_attention("_msa_att.mha.")},
    ),
)
_TRIANGLE = {"layer_norm": "layer_norm_z", "linear": "linear_z", **_gated_attention("mha.")}
register_converter(
    TriangleAttentionStartingNode,
    Converter("openfold.model.triangular_attention.TriangleAttentionStartingNode", children=_TRIANGLE),
)
register_converter(
    TriangleAttentionEndingNode,
    Converter("openfold.model.triangular_attention.TriangleAttentionEndingNode", children=_TRIANGLE),
)
register_converter(
    MSAColumnGlobalAttention,
    Converter(
        "openfold.model.msa.MSAColumnGlobalAttention",
        children={"layer_norm_m": "layer_norm_m", **_gated_attention("global_attention.")},
    ),
)


# Evoformer blocks and stacks. OpenFold's block keeps the pair updates in a `pair_stack` submodule;
# ours holds them directly. The other submodules keep their OpenFold names.


def _same(*names: str) -> dict[str, str]:
    return {name: name for name in names}


register_converter(
    MSATransition,
    Converter("openfold.model.evoformer.MSATransition", children=_same("layer_norm", "linear_1", "linear_2")),
)
register_converter(
    PairTransition,
    Converter("openfold.model.pair_transition.PairTransition", children=_same("layer_norm", "linear_1", "linear_2")),
)
register_converter(
    OuterProductMean,
    Converter(
        "openfold.model.outer_product_mean.OuterProductMean",
        children=_same("layer_norm", "linear_1", "linear_2", "linear_out"),
    ),
)
_TRIANGLE_MULTIPLICATION = _same(
    "layer_norm_in", "linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g", "linear_z", "layer_norm_out"
)
register_converter(
    TriangleMultiplicationOutgoing,
    Converter(
        "openfold.model.triangular_multiplicative_update.TriangleMultiplicationOutgoing",
        children=_TRIANGLE_MULTIPLICATION,
    ),
)
register_converter(
    TriangleMultiplicationIncoming,
    Converter(
        "openfold.model.triangular_multiplicative_update.TriangleMultiplicationIncoming",
        children=_TRIANGLE_MULTIPLICATION,
    ),
)
# AF2-Multimer's fused input projections (OpenFold's fuse_projection_weights): linear_ab_p and
# linear_ab_g in place of the four linear_a_p/a_g/b_p/b_g
_FUSED_TRIANGLE_MULTIPLICATION = _same(
    "layer_norm_in", "linear_ab_p", "linear_ab_g", "linear_g", "linear_z", "layer_norm_out"
)
register_converter(
    FusedTriangleMultiplicationOutgoing,
    Converter(
        "openfold.model.triangular_multiplicative_update.FusedTriangleMultiplicationOutgoing",
        children=_FUSED_TRIANGLE_MULTIPLICATION,
    ),
)
register_converter(
    FusedTriangleMultiplicationIncoming,
    Converter(
        "openfold.model.triangular_multiplicative_update.FusedTriangleMultiplicationIncoming",
        children=_FUSED_TRIANGLE_MULTIPLICATION,
    ),
)
_BLOCK = {
    **_same("msa_att_row", "msa_att_col", "msa_transition", "outer_product_mean"),
    **{f"pair_stack.{name}": name for name in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition")},
}
register_converter(EvoformerBlock, Converter("openfold.model.evoformer.EvoformerBlock", children=_BLOCK))
register_converter(ExtraMSABlock, Converter("openfold.model.evoformer.ExtraMSABlock", children=_BLOCK))
register_converter(
    EvoformerStack,
    Converter("openfold.model.evoformer.EvoformerStack", children={"blocks.*": "blocks.*", "linear": "linear"}),
)
register_converter(ExtraMSAStack, Converter("openfold.model.evoformer.ExtraMSAStack", children={"blocks.*": "blocks.*"}))


def _converter_for(module: nn.Module, path: str, converters: Mapping[type, Converter]) -> Converter:
    for cls in type(module).__mro__:
        if cls in converters:
            return converters[cls]
    where = f" (at {path!r})" if path else ""
    known = sorted(c.__name__ for c in converters)
    raise ValueError(
        f"no OpenFold converter for {type(module).__name__}{where}; register one with "
        f"evoformer_blocks.compat.register_converter (known: {', '.join(known)})"
    )


def _expand(module: nn.Module, openfold_path: str, our_path: str) -> Iterator[tuple[str, str]]:
    """(OpenFold path, our path) pairs; a ``.*`` pair expands over the entries of our list."""
    if openfold_path.endswith(".*") != our_path.endswith(".*"):
        raise ValueError(f"converter child {openfold_path!r} -> {our_path!r}: use '.*' on both sides or neither")
    if not our_path.endswith(".*"):
        yield openfold_path, our_path
        return
    container = module.get_submodule(our_path[:-2])
    for index, _ in container.named_children():
        yield f"{openfold_path[:-2]}.{index}", f"{our_path[:-2]}.{index}"


def _key_map(module: nn.Module, path: str, converters: Mapping[type, Converter]) -> dict[str, str]:
    converter = _converter_for(module, path, converters)
    out: dict[str, str] = {}
    if converter.same_names:
        out.update({name: name for name in module.state_dict() if "." not in name})
    out.update(converter.tensors)
    for openfold_child, our_child in converter.children.items():
        if getattr(module, our_child, 0) is None:  # an optional submodule left out (no tensors)
            continue
        for openfold_path, our_path in _expand(module, openfold_child, our_child):
            try:
                child = module.get_submodule(our_path)
            except AttributeError as error:
                raise ValueError(
                    f"converter of {type(module).__name__}: no submodule {our_path!r} ({error})"
                ) from None
            child_path = f"{path}.{our_path}" if path else our_path
            for openfold_key, our_key in _key_map(child, child_path, converters).items():
                out[f"{openfold_path}.{openfold_key}"] = f"{our_path}.{our_key}"
    return out


def openfold_key_map(module: nn.Module, converters: Mapping[type, Converter] = CONVERTERS) -> dict[str, str]:
    """OpenFold state_dict key -> our state_dict key, for every tensor of ``module``.

    ``converters``: the table to use (default :data:`CONVERTERS`, OpenFold's names; another
    implementation's, such as :data:`evoformer_blocks.compat_af3.OPENFOLD3_CONVERTERS`).

    Raises ValueError if a class in ``module`` has no converter, or if the converters do not name
    each tensor of ``module.state_dict()`` exactly once.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"openfold_key_map: `module` must be an nn.Module, got {type(module).__name__}")
    mapping = _key_map(module, "", converters)
    ours = list(module.state_dict())
    produced = list(mapping.values())
    uncovered = sorted(set(ours) - set(produced))
    unknown = sorted(set(produced) - set(ours))
    repeated = sorted(k for k, n in Counter(produced).items() if n > 1)
    if uncovered or unknown or repeated:
        raise ValueError(
            f"the OpenFold converters of {type(module).__name__} do not match its state_dict: "
            f"not mapped {uncovered}, mapped but absent {unknown}, mapped twice {repeated}"
        )
    return mapping


class LoadResult(NamedTuple):
    """What :func:`load_openfold_state_dict` skipped with ``strict=False`` (OpenFold key names)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_openfold_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
    converters: Mapping[type, Converter] = CONVERTERS,
) -> LoadResult:
    """Loads the state_dict of the corresponding OpenFold module into ``module``.

    ``state_dict`` uses OpenFold's names (e.g. ``mha.linear_q.weight``); it is not modified. Values
    are copied into ``module``'s parameters (cast to their dtype and device).

    Raises:
        ValueError: listing the keys of ``module`` missing from ``state_dict`` and the keys of
            ``state_dict`` it does not know (only with ``strict=True``), and every shape mismatch
            (always). Nothing is loaded when it raises.

    Returns:
        :class:`LoadResult` with the missing and unexpected OpenFold keys (empty when strict).
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"load_openfold_state_dict: `state_dict` must be a mapping of names to tensors, "
            f"got {type(state_dict).__name__}"
        )
    mapping = openfold_key_map(module, converters)
    targets = module.state_dict()
    missing = sorted(k for k in mapping if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in mapping)
    mismatched = []
    converted = {}
    for openfold_key, value in state_dict.items():
        if openfold_key not in mapping:
            continue
        our_key = mapping[openfold_key]
        want = tuple(targets[our_key].shape)
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        if got != want:
            mismatched.append(f"{openfold_key} (ours: {our_key}): expected shape {list(want)}, got {got}")
        converted[our_key] = value
    problems = []
    if strict and missing:
        problems.append("missing keys:\n    " + "\n    ".join(missing))
    if strict and unexpected:
        problems.append("unexpected keys:\n    " + "\n    ".join(unexpected))
    if mismatched:
        problems.append("shape mismatches:\n    " + "\n    ".join(mismatched))
    if problems:
        openfold_class = _converter_for(module, "", converters).openfold_class
        raise ValueError(
            f"load_openfold_state_dict: `state_dict` does not fit {type(module).__name__} "
            f"(OpenFold {openfold_class}):\n  " + "\n  ".join(problems)
        )
    module.load_state_dict(converted, strict=strict)
    return LoadResult([] if strict else missing, [] if strict else unexpected)


def to_openfold_state_dict(module: nn.Module, converters: Mapping[type, Converter] = CONVERTERS) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` under OpenFold's names (the reverse of :func:`load_openfold_state_dict`;
    ``converters`` as there)."""
    ours = module.state_dict()
    return {openfold_key: ours[our_key] for openfold_key, our_key in openfold_key_map(module, converters).items()}
