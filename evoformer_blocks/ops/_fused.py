"""The compiled CUDA extension shared by every fused ("cutlass") backend: its ops' schemas, their fake
implementations and access to the ops.

The ops (``torch.ops.evoformer_blocks_cuda``) are declared here, at import, and the extension
(csrc/, built on first use) registers their CUDA kernels. The backends call the ops
directly inside their autograd.Functions, eagerly and under torch.compile alike: a compiled graph
calls them as it calls an ATen op. Tracing one needs its fake implementation (output shapes, dtypes
and strides from the inputs' metadata), written beside the code that calls it (:func:`fake`); being
declared here, the ops trace on meta tensors without a build.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _build
from ._dispatch import constant_result

# Shapes and meanings: the header comments of each family's bindings, csrc/*/*_bindings.cpp
# (attention/attention_bindings.cpp, layer_norm/, triangle_multiplication/, outer_product_mean/, gating/,
# modules/).
SCHEMAS = (
    # attention
    "available_kernel_families(int device) -> str[]",
    "kernel_smem_bytes(str family, ScalarType dtype, int head_dim, ScalarType? pair_dtype) -> int",
    "attach_portable_kernels(str library) -> ()",
    "forward(Tensor q, Tensor k, Tensor v, Tensor? mask_bias, Tensor? pair_bias, float scale, str family) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "gated_forward(Tensor q, Tensor k, Tensor v, Tensor? mask_bias, Tensor? pair_bias, float scale, str family, "
    "Tensor gate, Tensor(a!) gated) -> (Tensor, Tensor, Tensor, Tensor)",
    "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor mask_prepared, "
    "Tensor? pair_bias, Tensor pair_prepared, float scale, str family, ScalarType? dmask_dtype, bool need_dpair) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "gated_attention_fwd(Tensor qkvg, Tensor? mask_bias, Tensor? pair_bias, int heads, bool transposed, "
    "float scale, str family) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "gated_attention_bwd(Tensor dy, Tensor qkvg, Tensor out, Tensor stats, Tensor mask_prepared, "
    "Tensor? pair_bias, Tensor pair_prepared, int heads, bool transposed, float scale, str family, "
    "ScalarType? dmask_dtype, bool need_dpair) -> (Tensor, Tensor, Tensor)",
    # block ops
    "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    "layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool need_affine, "
    "ScalarType affine_dtype) -> (Tensor, Tensor)",
    "add_layer_norm_fwd(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
    "Tensor? residual_scale=None, Tensor? residual_bias=None) -> (Tensor, Tensor, Tensor, Tensor)",
    "add_layer_norm_bwd(Tensor dsum, Tensor dy, Tensor sum, Tensor? weight, Tensor mean, Tensor rstd, "
    "bool need_affine, ScalarType affine_dtype, Tensor? residual_scale=None, ScalarType? residual_bias_dtype=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "triangle_multiplication_fwd(Tensor z, Tensor? mask, Tensor[] weights, float eps, bool outgoing, str family, "
    "bool for_backward=True, bool add_input=False, Tensor? update_scale=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "triangle_multiplication_bwd(Tensor dout, Tensor z, Tensor? mask, Tensor[] weights, Tensor[] saved, "
    "float eps, bool outgoing, Tensor? dz_add=None, str family=\"sm80\") -> Tensor[]",
    "sigmoid_gate_fwd(Tensor g, Tensor y) -> Tensor",
    "sigmoid_gate_bwd(Tensor dout, Tensor g, Tensor y) -> (Tensor, Tensor)",
    "sigmoid_gate_bwd_into(Tensor dout, Tensor g, Tensor y, Tensor(a!) dg, int delta_heads=0, int delta_len=0) "
    "-> (Tensor, Tensor)",
    "column_sum(Tensor x, ScalarType dtype) -> Tensor",
    "row_scale(Tensor x, Tensor s, Tensor? residual, bool divide) -> Tensor",
    "opm_project(Tensor outer, Tensor weight, Tensor? bias, Tensor? denom, Tensor? residual, str family) -> Tensor",
    "opm_project_input_grad(Tensor dout, Tensor weight, str family) -> Tensor",
    "opm_project_weight_grad(Tensor dout, Tensor outer, ScalarType weight_dtype) -> Tensor",
    "linear_bwd(Tensor dy, Tensor x, Tensor weight, Tensor? relu_out, bool need_dx, bool need_dw, bool need_db, "
    "ScalarType bias_dtype, int bias_from=0) -> (Tensor, Tensor, Tensor)",
    "rows_product(Tensor a, Tensor b) -> Tensor",
    # per-module autograd nodes (modules/): composite, each records its own node
    "gated_attention_module(Tensor x, Tensor? mask_bias, Tensor? pair_bias, Tensor w_q, Tensor w_k, Tensor w_v, "
    "Tensor w_g, Tensor? b_q, Tensor? b_g, Tensor w_o, Tensor? b_o, Tensor? w_head, Tensor? pair_source, int heads, "
    "bool transposed, bool transpose_head, float scale, str family) -> Tensor",
    "transition_module(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor? b2) -> Tensor",
    "add_layer_norm_node(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
    "Tensor? residual_scale=None, Tensor? residual_bias=None) -> (Tensor, Tensor)",
    "layer_norm_keeping_input_node(Tensor(a) x, Tensor? weight, Tensor? bias, float eps) -> (Tensor(a), Tensor)",
    "triangle_multiplication_module(Tensor z, Tensor? mask, Tensor norm_in_weight, Tensor norm_in_bias, "
    "Tensor w_a_p, Tensor w_a_g, Tensor w_b_p, Tensor w_b_g, Tensor? b_a_p, Tensor? b_a_g, Tensor? b_b_p, "
    "Tensor? b_b_g, Tensor w_g, Tensor? b_g, Tensor norm_out_weight, Tensor norm_out_bias, Tensor w_z, Tensor? b_z, "
    "float eps, bool outgoing, str family, bool add_input, Tensor? update_scale) -> Tensor",
    "triangle_multiplication_keeping_input_module(Tensor(a) z, Tensor? mask, Tensor norm_in_weight, "
    "Tensor norm_in_bias, Tensor w_a_p, Tensor w_a_g, Tensor w_b_p, Tensor w_b_g, Tensor? b_a_p, Tensor? b_a_g, "
    "Tensor? b_b_p, Tensor? b_b_g, Tensor w_g, Tensor? b_g, Tensor norm_out_weight, Tensor norm_out_bias, "
    "Tensor w_z, Tensor? b_z, float eps, bool outgoing, str family) -> (Tensor(a), Tensor)",
    "outer_product_mean_module(Tensor m, Tensor mask, Tensor? residual, Tensor w_1, Tensor b_1, Tensor w_2, "
    "Tensor b_2, Tensor w_out, Tensor? b_out, float eps, str family) -> Tensor",
    # an Evoformer block's update calling the nodes above (modules/block_node_bindings.cpp): composite
    "evoformer_block_module(Tensor m, Tensor z, Tensor msa_mask, Tensor pair_mask, Tensor row_mask_bias, "
    "Tensor column_mask_bias, Tensor start_mask_bias, Tensor end_mask_bias, Tensor?[] keeps, Tensor?[] params, "
    "float[] eps, int msa_heads, int pair_heads, bool end_transpose_head, str msa_family, str pair_family, "
    "str triangle_family) -> (Tensor, Tensor)",
)

_LIBRARY = torch.library.Library(_build.OP_NAMESPACE, "DEF")
for _schema in SCHEMAS:
    _LIBRARY.define(_schema)


def fake(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the function is the fake implementation of the extension's op ``name``."""
    return torch.library.register_fake(f"{_build.OP_NAMESPACE}::{name}", lib=_LIBRARY)


def kernels():
    """The extension's ops (``torch.ops.evoformer_blocks_cuda``), with their kernels: builds the
    extension on first use (under torch.compile the ops are taken as they are; selecting the
    backend, :func:`build_reasons`, built it when the graph was traced)."""
    if not torch.compiler.is_compiling():
        _build.load()
    return getattr(torch.ops, _build.OP_NAMESPACE)


@constant_result
def _extension_error() -> str:
    """'' when the kernels are built (building them on first call), else why not."""
    return _build.load_error() or ""


def build_reasons() -> list[str]:
    """[] when the extension is built (or builds now), else the reason it cannot be."""
    error = _extension_error()
    return [error] if error else []


PARAMETER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_parameter(t: torch.Tensor) -> torch.Tensor:
    """A parameter (weight, bias) as the block-op kernels read it, in its own dtype: contiguous,
    float16, bfloat16 or float32 (float64 is rounded to float32; autograd takes the gradient back)."""
    if t.dtype not in PARAMETER_DTYPES:
        t = t.float()
    return t.contiguous()
