"""Small forwards + backwards of every attention bias variant, of the fused triangle multiplication (with
and without its residual add) and of the outer product mean's tile GEMMs (with and without their
epilogue's division and residual add), run under compute-sanitizer by test_cutlass.py."""

import torch

import evoformer_blocks as eb
from evoformer_blocks import ops
from evoformer_blocks.ops import _fused, cutlass


def main() -> None:
    torch.manual_seed(0)
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [  # (head dim, L, q's dtype, pair bias dtype); float32 runs the TF32 kernels
        (32, 37, bf16, bf16), (64, 70, bf16, f32), (128, 19, bf16, None), (8, 1, bf16, None),
        (40, 19, f32, None), (128, 70, f32, f32),
    ]
    for head_dim, length, dtype, pair_dtype in cases:
        q, k, v = (torch.randn(1, 3, length, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        mask_bias = (1e9 * ((torch.rand(1, 3, 1, 1, length, device="cuda") > 0.2).float() - 1)).to(dtype).requires_grad_()
        pair_bias = None
        if pair_dtype is not None:
            pair_bias = torch.randn(1, 1, 2, length, length, device="cuda", dtype=pair_dtype, requires_grad=True)
        out = ops.evoformer_attention(q, k, v, mask_bias, pair_bias, backend="cutlass")
        out.float().square().sum().backward()
    # the triangle multiplication's fused kernels both ways: M a multiple of 8 and not, both widths'
    # buckets, the kernels without bounds checks (M = 144: whole slots and columns, a partial last tile)
    for n, c_z, c in [(12, 64, 32), (7, 48, 40), (9, 128, 128), (12, 128, 128), (12, 128, 64)]:
        module = eb.TriangleMultiplicationIncoming(c_z, c).to("cuda", torch.bfloat16)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
        z = torch.randn(1, n, n, c_z, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mask = (torch.rand(1, n, n, device="cuda") > 0.2).to(torch.bfloat16)
        module(z, mask).float().square().sum().backward()
        with torch.no_grad():  # the output kernel that writes no n_hat
            module(z, mask)
        # the output kernel adding z and a row-wise scale of the update as it writes
        keep = ((torch.rand(1, 1, n, c_z, device="cuda") > 0.25).float() / 0.75).to(torch.bfloat16)
        module._adding_to_input(z, mask, keep).float().square().sum().backward()
    # the outer product mean's tile GEMMs (c_hidden 32, c_z 128) called directly (the module's other
    # projections would add cuBLAS kernels, whose barriers racecheck does not model): rows past a
    # tile, J not a multiple of 32
    kernels = _fused.kernels()
    family = cutlass.kernel_family()
    for n_res in (37, 130):
        outer = torch.randn(2, 3, 32, n_res, 32, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(128, 32 * 32, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(128, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(2, 3, n_res, 128, device="cuda", dtype=torch.bfloat16)
        kernels.opm_project(outer, weight, bias, None, None, family)
        denom = torch.rand(2, 3, n_res, device="cuda").add(1.0).to(torch.bfloat16)
        residual = torch.randn(2, 3, n_res, 128, device="cuda", dtype=torch.bfloat16)
        kernels.opm_project(outer, weight, bias, denom, residual, family)  # with the division and residual add
        kernels.opm_project_input_grad(dout, weight, family)
        kernels.opm_project_weight_grad(dout, outer, torch.float32)
    torch.cuda.synchronize()
    print("sanitizer case done")


if __name__ == "__main__":
    main()
