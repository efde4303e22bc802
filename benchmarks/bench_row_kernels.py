"""The block ops' row kernels alone: layer norm, residual add + layer norm (forward and backward) and
the ReLU backward with its bias gradient (``linear``'s backward without the GEMMs), against the
PyTorch operations they replace, in one process, with the HBM rate each of ours reaches.

Cases: bf16 [rows, C] activations of the block benchmark's sizes: the MSA at N_seq 512, N_res 384
([196608, 256]), the pair at N_res 384 and 768 ([147456, 128], [589824, 128]) and the transitions'
hidden activations ([196608, 1024], [147456, 512]; only the ReLU backward runs there). Layer norms
have a bf16 weight and bias, as the modules do.

Bytes counted for our kernels (each [rows, C] tensor read or written once is one pass): layer norm
2 passes, add + layer norm 4 (x, residual in; sum, y out), layer-norm backward 3 (x, dy in; dx out),
add + layer-norm backward 4 (the sum's gradient too), ReLU backward + bias gradient 3 (dy, y in;
the masked dy out). PyTorch's side: ``F.layer_norm``; ``x + residual`` then ``F.layer_norm``;
``native_layer_norm_backward`` (with the add of the sum's gradient); ``threshold_backward`` then
``sum(0)`` in float32. Errors: max |ours - float32 reference| and the same for PyTorch's result.

    python benchmarks/bench_row_kernels.py [--shapes all|0,1] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CommandLine, markdown_table, median_ms, run_info_line, write_json, fmt  # noqa: E402

from evoformer_blocks.ops import _fused  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-5
CASES = [  # (label, rows, C, layer norms too)
    ("MSA [196608, 256]", 512 * 384, 256, True),
    ("pair N_res 384 [147456, 128]", 384 * 384, 128, True),
    ("pair N_res 768 [589824, 128]", 768 * 768, 128, True),
    ("MSA transition hidden [196608, 1024]", 512 * 384, 1024, False),
    ("pair transition hidden [147456, 512]", 384 * 384, 512, False),
]


def max_error(ours: torch.Tensor, theirs: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    return ((ours.float() - reference).abs().max().item(), (theirs.float() - reference).abs().max().item())


def layer_norm_ops(rows: int, c: int) -> list[tuple]:
    """(name, ours, torch's, passes, errors) for the four layer-norm operations on [rows, c]."""
    kernels = _fused.kernels()
    x, r, dy, ds = (torch.randn(rows, c, device="cuda", dtype=DTYPE) for _ in range(4))
    w = (1 + 0.1 * torch.randn(c, device="cuda")).to(DTYPE)
    b = (0.1 * torch.randn(c, device="cuda")).to(DTYPE)
    s, y, mean, rstd = kernels.add_layer_norm_fwd(x, r, w, b, EPS)
    _, mean_x, rstd_x = kernels.layer_norm_fwd(x, w, b, EPS)
    ref_ln = F.layer_norm(x.float(), (c,), w.float(), b.float(), EPS)
    ref_add = F.layer_norm((x + r).float(), (c,), w.float(), b.float(), EPS)
    # torch's backward takes its own saved statistics, [rows, 1]
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, (c,), w, b, EPS)
    _, ts_mean, ts_rstd = torch.ops.aten.native_layer_norm(s, (c,), w, b, EPS)
    mask = (True, True, True)

    def torch_bwd():
        return torch.ops.aten.native_layer_norm_backward(dy, x, (c,), t_mean, t_rstd, w, b, mask)

    def torch_add_bwd():
        return torch.ops.aten.native_layer_norm_backward(dy, s, (c,), ts_mean, ts_rstd, w, b, mask)[0] + ds

    ref_dx = torch.ops.aten.native_layer_norm_backward(
        dy.float(), x.float(), (c,), t_mean, t_rstd, w.float(), b.float(), mask)[0]
    dx = kernels.layer_norm_bwd(dy, x, w, mean_x, rstd_x, True, DTYPE)[0]
    return [
        ("layer norm", lambda: kernels.layer_norm_fwd(x, w, b, EPS), lambda: F.layer_norm(x, (c,), w, b, EPS), 2,
         max_error(kernels.layer_norm_fwd(x, w, b, EPS)[0], F.layer_norm(x, (c,), w, b, EPS), ref_ln)),
        ("add + layer norm", lambda: kernels.add_layer_norm_fwd(x, r, w, b, EPS),
         lambda: F.layer_norm(x + r, (c,), w, b, EPS), 4, max_error(y, F.layer_norm(x + r, (c,), w, b, EPS), ref_add)),
        ("layer norm backward", lambda: kernels.layer_norm_bwd(dy, x, w, mean_x, rstd_x, True, DTYPE), torch_bwd, 3,
         max_error(dx, torch_bwd()[0], ref_dx)),
        ("add + layer norm backward", lambda: kernels.add_layer_norm_bwd(ds, dy, s, w, mean, rstd, True, DTYPE),
         torch_add_bwd, 4, None),
    ]


def relu_ops(rows: int, c: int) -> list[tuple]:
    """The ReLU backward and bias gradient of a [rows, c] ReLU output."""
    kernels = _fused.kernels()
    dy = torch.randn(rows, c, device="cuda", dtype=DTYPE)
    y = torch.relu(torch.randn_like(dy))
    x = torch.randn(rows, 8, device="cuda", dtype=DTYPE)  # (only shapes matter: no GEMM is asked for)
    w = torch.randn(c, 8, device="cuda", dtype=DTYPE)

    def ours():
        return kernels.linear_bwd(dy, x, w, y, False, False, True, DTYPE)[2]

    def theirs():
        return torch.ops.aten.threshold_backward(dy, y, 0).sum(0, dtype=torch.float32).to(DTYPE)

    reference = torch.where(y > 0, dy, torch.zeros_like(dy)).double().sum(0).float()
    return [("ReLU backward + bias gradient", ours, theirs, 3, max_error(ours(), theirs(), reference))]


def main() -> None:
    cli = CommandLine(__doc__, shapes=[label for label, *_ in CASES], impls=["ours"])
    args = cli.parse()
    print(run_info_line(), flush=True)
    table, results = [], []
    for index in args.shapes:
        label, rows, c, norms = CASES[index]
        mb = rows * c * torch.finfo(DTYPE).bits / 8 / 1e6  # one pass, MB
        for name, ours, theirs, passes, errors in (layer_norm_ops(rows, c) if norms else []) + relu_ops(rows, c):
            ours_ms, torch_ms = median_ms(ours), median_ms(theirs)
            rate = passes * mb / ours_ms / 1e3  # MB per ms = GB/s; / 1e3: TB/s
            err = "–" if errors is None else f"{errors[0]:.2g} ({errors[1]:.2g})"
            table.append([label, name, fmt(ours_ms * 1e3, 1), fmt(torch_ms * 1e3, 1), f"{torch_ms / ours_ms:.2f}",
                          fmt(rate, 2), err])
            results.append({"case": label, "op": name, "ours_ms": ours_ms, "torch_ms": torch_ms, "passes": passes,
                            "ours_tb_per_s": rate, "max_error": errors})
            print(f"  {label} {name}: {ours_ms * 1e3:.1f} us, torch {torch_ms * 1e3:.1f} us", flush=True)
        torch.cuda.empty_cache()
    print(markdown_table(["case", "op", "ours µs", "PyTorch µs", "PyTorch / ours", "ours TB/s",
                          "max error ours (PyTorch)"], table))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
