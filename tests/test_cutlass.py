"""The fused CUDA backend against an fp32 reference, with the same-dtype eager backend as the bar.

The tests marked with @gpu need a CUDA GPU of compute capability >= 8.0 and are skipped without one;
the others check, on any machine, what the Python side derives from csrc/kernel_table.json and
the fake implementations' shapes. Outputs are poisoned with NaN before every
kernel launch (EVOFORMER_BLOCKS_POISON=1), so an element a kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("EVOFORMER_BLOCKS_POISON", "1")

from evoformer_blocks import ops  # noqa: E402
from evoformer_blocks.ops import _build, cutlass  # noqa: E402
from gpu import HOPPER, kernel_family, requires_sm80  # noqa: E402,F401 (kernel_family: a fixture)


def gpu(test):
    """Marks a test that needs a CUDA GPU of compute capability >= 8.0."""
    for mark in requires_sm80:
        test = mark(test)
    return test


# Every test runs once per kernel family (gpu.kernel_family: on a Hopper GPU the Hopper kernels and
# the portable sm80 ones).
pytestmark = pytest.mark.usefixtures("kernel_family")


@gpu
def test_kernel_family_selection(kernel_family):
    expected = "sm90" if HOPPER and kernel_family == "auto" else "sm80"
    assert cutlass.kernel_family() == expected
    assert expected in cutlass.available_kernel_families(torch.cuda.current_device())


@gpu
def test_backward_runs_the_family_of_its_forward(kernel_family, monkeypatch):
    q, k, v, mask_bias, pair_bias = make_inputs(1, 3, 40, 40, 2, 32, torch.bfloat16, "both")
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, mask_bias, pair_bias)]
    out = cutlass.attention(*leaves, 0.25)
    assert out.grad_fn.family == cutlass.kernel_family()
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", "sm80" if kernel_family == "auto" else "auto")
    out.backward(dout)
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", kernel_family)
    again = [t.clone().requires_grad_(True) for t in (q, k, v, mask_bias, pair_bias)]
    cutlass.attention(*again, 0.25).backward(dout)
    for first, second in zip(leaves, again):
        assert torch.equal(first.grad, second.grad)


def test_kernel_family_rejects_unknown_setting(monkeypatch):
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", "sm90")
    with pytest.raises(ValueError, match="EVOFORMER_BLOCKS_KERNELS"):
        cutlass.kernel_family("cuda:0")


def test_capabilities_come_from_the_kernel_table():
    table = json.loads((Path(cutlass.__file__).resolve().parents[2] / "csrc/kernel_table.json").read_text())
    caps = ops.get_backend("cutlass").capabilities
    assert caps.dtypes == tuple(getattr(torch, d["torch"]) for d in table["dtypes"] + [table["tf32"]["dtype"]])
    assert (cutlass.TF32_DTYPE, cutlass.TF32_MAX_HEAD_DIM) == (torch.float32, table["tf32"]["max_head_dim"])
    assert table["tf32"]["families"] == [cutlass.TF32_FAMILY]
    assert (caps.head_dim_multiple, caps.max_head_dim) == (table["head_dim"]["multiple"], table["head_dim"]["max"])
    assert caps.min_compute_capability == tuple(table["min_compute_capability"])
    grid = table["grid"]
    rows = 2 ** grid["max_x_log2"] // 2  # with 2 row tiles each: B * N * ceil(L / row_tile) = 2^max_x_log2
    q = torch.empty(1, rows, grid["row_tile"] + 1, grid["max_heads"] + 1, 8, device="meta", dtype=torch.bfloat16)
    reasons = ops.get_backend("cutlass").extra_reasons(ops.validate(q, q, q))
    assert len(reasons) == 2 and "grid size" in reasons[0] and f"exceeds {grid['max_heads']}" in reasons[1]


@pytest.mark.parametrize("head_dim", [8, 72, 128])
def test_float32_takes_every_head_dim_of_the_16_bit_kernels(head_dim):
    assert cutlass.TF32_MAX_HEAD_DIM == ops.get_backend("cutlass").capabilities.max_head_dim
    rows = 2 ** 31 // 64  # the grid rule makes the list non-empty without building the extension
    q = torch.empty(1, rows, 65, 1, head_dim, device="meta", dtype=torch.float32)
    assert not any("TF32" in r for r in ops.get_backend("cutlass").extra_reasons(ops.validate(q, q, q)))


def test_float32_beyond_a_smaller_tf32_limit_is_refused_with_a_reason(monkeypatch):
    # kernel_table.json may give float32 fewer head-dim buckets than the 16-bit kernels: the
    # backend then names the rule (and `auto` runs such inputs on eager)
    monkeypatch.setattr(cutlass, "TF32_MAX_HEAD_DIM", 64)
    q = torch.empty(1, 2, 10, 2, 72, device="meta", dtype=torch.float32)
    reasons = ops.get_backend("cutlass").extra_reasons(ops.validate(q, q, q))
    assert reasons and reasons[0] == "`q` is float32 with head dim D=72: the float32 (TF32) kernels take D <= 64"
    q16 = q.to(torch.bfloat16)
    assert not any("TF32" in r for r in ops.get_backend("cutlass").extra_reasons(ops.validate(q16, q16, q16)))


def test_auto_keeps_float32_on_cpu_eager():
    from evoformer_blocks.ops._dispatch import ATTENTION_OP, select

    q = torch.randn(1, 2, 5, 2, 16)
    assert select(ATTENTION_OP, ops.validate(q, q, q), None).name == "eager"
    with pytest.raises(ValueError, match="device type 'cpu'"):
        ops.evoformer_attention(q, q, q, backend="cutlass")


def test_float32_family_is_sm80(monkeypatch):
    # float32 has kernels in the portable family only: the choice never reaches the extension
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", "sm80")
    assert cutlass.kernel_family("cuda:0", torch.float32) == "sm80"


def test_block_op_rules_come_from_the_kernel_table():
    from evoformer_blocks.ops import triangle

    table = json.loads((Path(cutlass.__file__).resolve().parents[2] / "csrc/kernel_table.json").read_text())
    opm = table["outer_product_mean"]
    assert (cutlass.OPM_HIDDEN, cutlass.OPM_TILE, cutlass.OPM_MAX_BATCHES) == (opm["hidden"], opm["tile"], opm["max_batches"])
    rows = table["row_kernels"]
    assert cutlass.MAX_ROW_BYTES == rows["max_lanes"] * rows["max_chunks_per_lane"] * rows["chunk_bytes"]
    assert triangle._CHANNEL_MULTIPLE == rows["chunk_bytes"] // 2  # 16-bit values per chunk
    assert triangle._MAX_CHANNELS == cutlass.MAX_ROW_BYTES // 2


def test_kernel_sources_are_one_translation_unit_per_family_file():
    # The JIT build compiles every .cpp and .cu under csrc/: one bindings file per family (the
    # per-module nodes, modules/, one per node family, and the block's), the families' launchers and one file per
    # attention instantiation, named uniquely (ninja names each object after its source's file name).
    root = Path(cutlass.__file__).resolve().parents[2] / "csrc"
    sources = _build.sources()
    assert [s.relative_to(root).as_posix() for s in sources if s.suffix == ".cpp"] == [
        "attention/attention_bindings.cpp", "gating/gating_bindings.cpp", "layer_norm/layer_norm_bindings.cpp",
        "modules/block_node_bindings.cpp", "modules/modules_bindings.cpp", "modules/opm_node_bindings.cpp",
        "modules/triangle_node_bindings.cpp",
        "outer_product_mean/opm_bindings.cpp", "triangle_multiplication/triangle_bindings.cpp"]
    assert all(s.name.endswith("_bindings.cpp") for s in sources if s.suffix == ".cpp")
    instantiations = [s for s in sources if s.parent.name == "instantiations"]
    assert len(instantiations) == len(list((root / "attention/instantiations").glob("*.cu"))) > 0
    assert not any(s.relative_to(root).parts[0] == "common" for s in sources)  # headers only
    assert len({s.stem for s in sources}) == len(sources)


def test_build_starts_the_longest_compiles_first():
    # ninja starts a fresh build's jobs in the order given: the Hopper units (25-30 s each on 16
    # cores) must not be left for the last wave.
    sources = _build.sources()
    order = _build.compile_order(sources)
    assert sorted(order) == sorted(sources)
    names = [s.stem for s in order]
    hopper = [i for i, n in enumerate(names) if "_sm90" in n]
    assert names[0] == "triangle_input_sm90" and hopper == list(range(len(hopper)))
    assert names.index("backward_sm90_bf16_d128_pair") < names.index("forward_sm90_bf16_d128_pair")
    assert names.index("backward_sm90_bf16_d128_pair") < names.index("backward_sm90_bf16_d32_pair")
    portable = [i for i, n in enumerate(names) if "_sm80" in n]
    assert portable == list(range(len(names) - len(portable), len(names)))  # the short units last
    assert all(len(hopper) <= names.index(n) < portable[0] for n in names if n.endswith("_bindings"))
    host = [n for n in names if "_sm90" not in n and "_sm80" not in n]
    slow = [n for n in _build.SLOW_HOST_UNITS if n in host]
    assert len(slow) == len(_build.SLOW_HOST_UNITS) and host[:len(slow)] == slow  # (each names a source)


def test_hopper_only_build_keeps_the_portable_16bit_kernels_apart():
    # An all-9.0a build leaves the 36 portable 16-bit instantiations out of the core library (they
    # build on first use of the sm80 family); any other build holds everything but their entry point.
    everything = _build.sources()
    names = lambda paths: sorted(p.stem for p in paths)  # noqa: E731
    portable = [p for p in everything if re.match(r"(forward|backward)_sm80_(fp16|bf16)_", p.stem)]
    table = json.loads(cutlass.TABLE_PATH.read_text())
    per_direction = len(table["head_dim"]["buckets"]) * len(table["pair_kinds"]) * 2  # two 16-bit dtypes
    assert len(portable) == 2 * per_direction
    entry = [p for p in everything if p.stem == "portable_kernels"]
    assert len(entry) == 1
    for arch in ("9.0a", "9.0a;9.0a+PTX"):
        assert _build.portable_apart(arch)
        core = _build.core_sources(arch)
        assert names(core) == names(set(everything) - set(portable) - set(entry))
        assert "-DEVOFORMER_PORTABLE_APART" in _build._flags(arch)[0] + _build._flags(arch)[1]
    for arch in ("8.0", "8.0;9.0a", "8.6", "9.0"):
        assert not _build.portable_apart(arch)
        assert names(_build.core_sources(arch)) == names(set(everything) - set(entry))
        assert "-DEVOFORMER_PORTABLE_APART" not in _build._flags(arch)[0] + _build._flags(arch)[1]
    assert names(_build.portable_sources()) == sorted(names(portable + entry) + ["attention"])


def test_generated_kernel_sources_are_current():
    script = Path(cutlass.__file__).resolve().parents[2] / "csrc/generate.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_binding_errors_are_joined_without_streams():
    # The bindings' checks go through EVO_CHECK (bindings_common.h), which joins the message itself:
    # TORCH_CHECK with several pieces (c10::str), c10::Join and string streams construct a stream
    # inside the extension, and with some torch wheels that ends the process instead of raising.
    sources = Path(cutlass.__file__).resolve().parents[2] / "csrc"
    found = []
    for path in sorted(sources.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if code.lstrip().startswith("#define EVO_CHECK("):
                continue
            found += [f"{path.relative_to(sources)}:{number}: {word}" for word in ("TORCH_CHECK", "c10::str", "c10::Join",
                                                                   "stringstream", "<sstream>") if word in code]
    assert not found, found


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize(
    "make,needs_copy",
    [
        (lambda: meta(2, 1, 4, 20, 24), False),  # bf16 rows of 48 bytes
        (lambda: meta(2, 1, 4, 20, 21), True),  # rows not a multiple of 16 bytes
        (lambda: meta(2, 1, 4, 20, 4, dtype=torch.float32), False),
        (lambda: meta(1, 1, 1, 20, 24).expand(2, 1, 4, 20, 24), False),  # broadcast: stride 0
        (lambda: meta(2, 1, 4, 24, 24).transpose(3, 4), True),  # keys not contiguous
        (lambda: meta(2, 1, 4, 20, 32)[..., 4:28], True),  # rows start 8 bytes off
        (lambda: meta(2, 1, 4, 20, 32)[..., 8:32], False),
    ],
)
def test_pair_needs_copy(make, needs_copy):
    assert cutlass.pair_needs_copy(make()) is needs_copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("len_k", [21, 24])  # the pair bias copied or read in place
def test_compile_fullgraph_traces_the_fakes(len_k, dtype, monkeypatch):
    # The extension ops' fakes carry torch.compile through forward and backward without a GPU (meta
    # tensors; the sm80 setting keeps the family choice from asking the extension).
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", "sm80")

    def leaf(*shape, dtype=dtype):
        return meta(*shape, dtype=dtype).requires_grad_(True)

    q, k, v = leaf(1, 2, 20, 2, 32), leaf(1, 2, len_k, 2, 32), leaf(1, 2, len_k, 2, 32)
    mask_bias, pair_bias = leaf(1, 2, 1, 1, len_k), leaf(1, 1, 2, 20, len_k, dtype=torch.float32)
    compiled = torch.compile(lambda *args: cutlass.attention(*args, 0.25) * 2, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, mask_bias, pair_bias)
    out.float().sum().backward()
    assert out.shape == q.shape
    for t in (q, k, v, mask_bias, pair_bias):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize(
    "dtype,pair_dtype,len_k",
    [
        (torch.bfloat16, None, 21),
        (torch.bfloat16, torch.bfloat16, 21),
        (torch.bfloat16, torch.float32, 24),
        (torch.float32, None, 21),
        (torch.float32, torch.float32, 21),
        (torch.float32, torch.float32, 24),
    ],
)
def test_fake_shapes(with_mask, dtype, pair_dtype, len_k):
    q, k = meta(2, 3, 20, 4, 32, dtype=dtype), meta(2, 3, len_k, 4, 32, dtype=dtype)
    mask_bias = meta(1, 3, 1, 1, len_k, dtype=dtype) if with_mask else None
    pair_bias = meta(2, 1, 4, 20, len_k, dtype=pair_dtype) if pair_dtype else None
    copy_pair = pair_bias is not None and len_k % (16 // pair_bias.element_size()) != 0
    kernels = torch.ops.evoformer_blocks_cuda  # (meta tensors run the fake implementations: no build)
    out, stats, mask_prepared, pair_prepared = kernels.forward(q, k, k, mask_bias, pair_bias, 0.25, "sm80")
    assert out.shape == q.shape and out.dtype == dtype and stats.shape == (2, 3, 4, 20, 2)
    assert stats.dtype == torch.float32
    assert mask_prepared.dtype == torch.float32
    assert mask_prepared.shape == ((1, 3, 24) if with_mask else (0,))  # Lk padded to whole 16-byte rows
    if pair_bias is not None and copy_pair:
        assert pair_prepared.shape == (2, 4, 20, 24) and pair_prepared.dtype == pair_dtype
    else:
        assert pair_prepared.shape == (0,)
    dmask_dtype = torch.float32 if with_mask else None
    grads = kernels.backward(
        q, q, k, k, out, stats, mask_prepared, pair_bias, pair_prepared, 0.25, "sm80", dmask_dtype, pair_bias is not None
    )
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, k.shape]
    assert [g.dtype for g in grads[:3]] == [dtype] * 3
    assert grads[3].shape == ((1, 3, 1, 1, len_k) if with_mask else (0,))
    assert grads[3].dtype == (torch.float32 if with_mask else q.dtype)
    assert grads[4].shape == (pair_bias.shape if pair_bias is not None else (0,))


# Pass rule: error(fused) <= RATIO * error(eager, same dtype) + FLOOR[dtype, direction], errors as
# ||x - ref|| / ||ref|| against the fp32 reference. Where the exact value is zero (at L = 1 softmax is
# exactly 1, so dq, dk and the bias gradients vanish) the eager backend returns exact zeros while any
# fused kernel returns fp32 rounding noise: there the fused tensor's RMS must stay under ZERO_RMS.
RATIO = 2.0
ZERO_RMS = 1e-5
FLOOR = {
    (torch.bfloat16, "forward"): 1e-4,
    (torch.bfloat16, "backward"): 1e-4,
    (torch.float16, "forward"): 1e-4,
    (torch.float16, "backward"): 1e-4,
    # float32 runs on the TF32 tensor cores; its reference is float64 and its bar the larger error
    # of eager float32 with TF32 matmuls and of eager float32 on q, k, v, dO rounded to TF32 (cuBLAS
    # keeps small products in float32, so only the second shows what rounding the operands costs).
    # The floor is about one TF32 rounding of the values (2^-12 relative at most).
    (torch.float32, "forward"): 2e-4,
    (torch.float32, "backward"): 2e-4,
}
GRAD_NAMES = ("q", "k", "v", "mask_bias", "pair_bias")


def rms(x: torch.Tensor) -> float:
    return x.double().norm().item() / max(x.numel(), 1) ** 0.5


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).norm().item() / ref.double().norm().item()


def make_inputs(batch, rows, len_q, len_k, heads, head_dim, dtype, variant, bias_dtype=None, seed=0, masked_frac=0.1):
    """Fresh random inputs; `variant` is one of none / mask / pair / both."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    bias_dtype = bias_dtype or dtype

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

    q = randn(batch, rows, len_q, heads, head_dim)
    k = randn(batch, rows, len_k, heads, head_dim)
    v = randn(batch, rows, len_k, heads, head_dim)
    mask_bias = pair_bias = None
    if variant in ("mask", "both"):
        keep = torch.rand(batch, rows, 1, 1, len_k, generator=gen, device=dev) > masked_frac
        mask_bias = (1e9 * (keep.float() - 1)).to(bias_dtype)
    if variant in ("pair", "both"):
        pair_bias = randn(batch, 1, heads, len_q, len_k, dt=bias_dtype)
    return q, k, v, mask_bias, pair_bias


def run(backend, q, k, v, mask_bias, pair_bias, dout, cast=None):
    """Forward + backward on `backend`; returns (out, grads dict). `cast` converts inputs first."""
    leaves = {}
    for name, t in zip(GRAD_NAMES, (q, k, v, mask_bias, pair_bias)):
        if t is None:
            continue
        t = t.detach()
        if cast is not None:
            t = t.to(cast)
        leaves[name] = t.requires_grad_(True)
    out = ops.evoformer_attention(
        leaves["q"], leaves["k"], leaves["v"], leaves.get("mask_bias"), leaves.get("pair_bias"), backend=backend
    )
    out.backward(dout.to(out.dtype))
    return out.detach(), {name: t.grad for name, t in leaves.items()}


def check_against_reference(q, k, v, mask_bias, pair_bias, seed=1, ref_dtype=None):
    """The pass rule above for the output and every gradient; the reference is the eager backend
    in `ref_dtype` (default: float32, float64 for float32 inputs), the bar eager in q's dtype (with
    TF32 matmuls for float32 inputs)."""
    tf32 = q.dtype == torch.float32
    ref_dtype = ref_dtype or (torch.float64 if tf32 else torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(q.shape, generator=gen, device="cuda")
    ref_out, ref_grads = run("eager", q, k, v, mask_bias, pair_bias, dout, cast=ref_dtype)
    bar = eager_with_tf32_matmuls if tf32 else functools.partial(run, "eager")
    eager_out, eager_grads = bar(q, k, v, mask_bias, pair_bias, dout)
    rounded = eager_with_tf32_matmuls(*map(tf32_rounded, (q, k, v)), mask_bias, pair_bias, tf32_rounded(dout)) if tf32 else None
    fused_out, fused_grads = run("cutlass", q, k, v, mask_bias, pair_bias, dout)
    dtype = q.dtype
    assert fused_out.dtype == dtype and fused_out.shape == q.shape
    report = []
    for name, fused, eager, ref, direction in [("out", fused_out, eager_out, ref_out, "forward")] + [
        (n, fused_grads[n], eager_grads[n], ref_grads[n], "backward") for n in ref_grads
    ]:
        assert fused.shape == ref.shape, name
        assert torch.isfinite(fused).all(), f"{name}: non-finite values (unwritten or NaN)"
        if rms(ref) == 0.0:
            report.append(f"{name}: exact zero, fused RMS {rms(fused):.1e}")
            assert rms(fused) <= ZERO_RMS, f"{name}: exact value 0, fused RMS {rms(fused):.3e} > {ZERO_RMS}"
            continue
        e_fused, e_eager = rel_error(fused, ref), rel_error(eager, ref)
        if rounded is not None:
            e_eager = max(e_eager, rel_error(rounded[0] if name == "out" else rounded[1][name], ref))
        allowed = RATIO * e_eager + FLOOR[(dtype, direction)]
        report.append(f"{name}: fused {e_fused:.2e} eager {e_eager:.2e}")
        assert e_fused <= allowed, f"{name}: fused error {e_fused:.3e} > {allowed:.3e} (eager {e_eager:.3e})"
    return report


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("variant", ["none", "mask", "pair", "both"])
@pytest.mark.parametrize("length", [1, 17, 128, 1000])
def test_matches_reference(dtype, head_dim, variant, length):
    rows = 3 if length < 1000 else 2
    inputs = make_inputs(2, rows, length, length, 2, head_dim, dtype, variant, seed=length + head_dim)
    check_against_reference(*inputs)


# A -inf pair-bias entry leaves its key out of the row, as in eager, and as a -inf mask bias on that key
# would. Every row keeps finite keys (a row of -inf alone is NaN in eager).
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_minus_inf_pair_bias_leaves_keys_out(dtype, head_dim):
    q, k, v, mask_bias, pair_bias = make_inputs(1, 3, 70, 70, 2, head_dim, dtype, "both", seed=head_dim)
    gen = torch.Generator(device="cuda").manual_seed(7)
    excluded = torch.rand(pair_bias.shape, generator=gen, device="cuda") < 0.3
    excluded[..., :4] = False
    pair_bias = pair_bias.masked_fill(excluded, float("-inf"))
    check_against_reference(q, k, v, mask_bias, pair_bias)
    # the same bits as leaving those keys out by the mask bias, which is per key of a row n: one query
    # and one head per row, so that the pair bias is per key too
    q0, k0, v0 = q[:, :, :1, :1], k[:, :, :, :1], v[:, :, :, :1]  # [1, 3, 1, 1, D], [1, 3, 70, 1, D] x 2
    pair0 = pair_bias[:, :, :1, :1]  # [1, 1, 1, 1, 70]: head 0, query 0
    out_pair = ops.evoformer_attention(q0, k0, v0, mask_bias, pair0, backend="cutlass")
    out_mask = ops.evoformer_attention(q0, k0, v0, mask_bias.masked_fill(torch.isinf(pair0), float("-inf")),
                                       pair0.masked_fill(torch.isinf(pair0), 0.0), backend="cutlass")
    assert torch.isfinite(out_pair).all()
    torch.testing.assert_close(out_pair, out_mask, rtol=0.0, atol=0.0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["mask", "pair", "both"])
@pytest.mark.parametrize("head_dim", [32, 72])
def test_float32_biases(dtype, variant, head_dim):
    inputs = make_inputs(1, 4, 77, 77, 3, head_dim, dtype, variant, bias_dtype=torch.float32)
    check_against_reference(*inputs)


def tf32_rounded(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` rounded to TF32's 10-bit mantissa (to nearest, ties away from zero: cvt.rna),
    as the fused kernels round their tensor-core operands."""
    bits = t.detach().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def eager_with_tf32_matmuls(*args, **kwargs):
    """`run` on the eager backend with torch.backends.cuda.matmul.allow_tf32 = True (restored after)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return run("eager", *args, **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@gpu
@pytest.mark.parametrize("head_dim", [8, 24, 40, 64, 72, 128])
@pytest.mark.parametrize("variant", ["none", "mask", "pair", "both"])
@pytest.mark.parametrize("length", [1, 7, 17, 1000])
def test_float32_matches_reference(head_dim, variant, length):
    rows = 3 if length < 1000 else 2
    inputs = make_inputs(2, rows, length, length, 2, head_dim, torch.float32, variant, seed=length + head_dim)
    check_against_reference(*inputs)


@gpu
def test_float32_runs_the_sm80_family(kernel_family):
    # on a Hopper GPU too, whatever EVOFORMER_BLOCKS_KERNELS says
    q, k, v, mask_bias, pair_bias = make_inputs(1, 3, 40, 40, 2, 32, torch.float32, "both")
    out = cutlass.attention(*(t.requires_grad_(True) for t in (q, k, v, mask_bias, pair_bias)), 0.25)
    assert out.grad_fn.family == "sm80" == cutlass.kernel_family(q.device, torch.float32)
    if "sm90" in cutlass.available_kernel_families(torch.cuda.current_device()):
        with pytest.raises(RuntimeError, match="sm80 kernel family only"):
            cutlass._kernels().forward(q.detach(), k.detach(), v.detach(), None, None, 0.25, "sm90")


@gpu
def test_extension_errors_name_the_values(kernel_family):
    # a direct call of the extension with a bad argument raises (never ends the process) and its
    # message shows the values: numbers and tensors as the bindings join them (bindings_common.h)
    q, k, v, _, _ = make_inputs(1, 2, 24, 24, 2, 32, torch.bfloat16, "none")
    family = cutlass.kernel_family(q.device, q.dtype)
    with pytest.raises(RuntimeError, match=r"`scale` must be positive and finite, got -1\.5"):
        cutlass._kernels().forward(q, k, v, None, None, -1.5, family)
    with pytest.raises(RuntimeError, match=r"k and v must have one shape; k: shape=\[1, 2, 24, 2, 32\] "
                                           r"dtype=BFloat16 device=cuda:\d+ stride=\[3072, 1536, 64, 32, 1\]"):
        cutlass._kernels().forward(q, k, v[:, :, :20], None, None, 0.25, family)
    with pytest.raises(RuntimeError, match=r"must be one of the kernel families this build runs on device \d+ "
                                           r"\(sm80(, sm90)?\), got `sm70`"):
        cutlass._kernels().forward(q, k, v, None, None, 0.25, "sm70")


@gpu
def test_auto_runs_float32_fused():
    # auto picks the cutlass backend for float32, and nothing [B, N, H, L, L] is allocated: the
    # float32 logits alone would take 256 MiB here, q, k, v 16 MiB each.
    from evoformer_blocks.ops._dispatch import ATTENTION_OP, select

    q, k, v, mask_bias, _ = make_inputs(1, 64, 512, 512, 4, 32, torch.float32, "mask")
    assert select(ATTENTION_OP, ops.validate(q, k, v, mask_bias), None).name == "cutlass"
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    ops.evoformer_attention(*leaves, mask_bias, backend="auto")  # builds, warms up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = ops.evoformer_attention(*leaves, mask_bias, backend="auto")
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    logits_bytes = 64 * 4 * 512 * 512 * 4
    assert torch.cuda.max_memory_allocated() - before < logits_bytes // 2


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("len_q,len_k", [(33, 100), (130, 7)])
def test_query_and_key_lengths_differ(len_q, len_k, dtype):
    check_against_reference(*make_inputs(1, 3, len_q, len_k, 2, 32, dtype, "both"))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_broadcast_biases(dtype):
    q, k, v, _, _ = make_inputs(2, 3, 40, 40, 4, 32, dtype, "none")
    mask_bias = (1e9 * ((torch.rand(1, 3, 1, 1, 40, device="cuda") > 0.2).float() - 1)).to(dtype)  # B broadcast
    pair_bias = torch.randn(2, 1, 1, 40, 40, device="cuda").to(dtype)  # H broadcast
    check_against_reference(q, k, v, mask_bias, pair_bias)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mask_value", [-1e9, float("-inf")])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_fully_masked_rows(mask_value, dtype, head_dim):
    q, k, v, mask_bias, pair_bias = make_inputs(1, 4, 50, 50, 2, head_dim, dtype, "both")
    mask_bias[:, 1] = mask_value  # every key of row n = 1 masked
    mask_bias[:, 2, ..., 10:] = mask_value  # most keys of row n = 2 masked
    check_against_reference(q, k, v, mask_bias, pair_bias)
    out = ops.evoformer_attention(q, k, v, mask_bias, pair_bias, backend="cutlass")
    if mask_value == float("-inf"):
        assert (out[:, 1] == 0).all()  # a query with no key attends to nothing


# Rows whose maximum rises from one block of 64 keys to the next (the kernels step through the keys in
# such blocks, rescaling what they accumulated at each new row maximum): "rising" lifts the pair bias
# by 50 per block (72 in log2 units) on some queries, by 20 (29) on others and leaves the rest;
# "unmasked_late" masks the first 70 keys of some rows, so that their first finite scores come in
# the second block, far above the mask's fill (float16 masks at its lowest finite value instead of
# -1e9, which it cannot hold).
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pattern", ["rising", "unmasked_late"])
@pytest.mark.parametrize("mask_value", [-1e9, float("-inf")])
@pytest.mark.parametrize("head_dim,length", [(32, 300), (64, 200), (128, 130)])
def test_rows_whose_maximum_rises_across_key_blocks(dtype, pattern, mask_value, head_dim, length):
    q, k, v, mask_bias, pair_bias = make_inputs(1, 3, length, length, 2, head_dim, dtype, "both", seed=head_dim)
    # the mask's fill: float16 takes its lowest finite value for -1e9
    fill = torch.finfo(dtype).min if dtype == torch.float16 and mask_value == -1e9 else mask_value
    if pattern == "rising":
        block = (torch.arange(length, device="cuda") // 64).float()  # [L] keys
        slope = torch.tensor([50.0, 20.0, 0.0], device="cuda")[torch.arange(length, device="cuda") % 3]  # [L] queries
        pair_bias = (pair_bias.float() + slope[:, None] * block).to(dtype)  # [1, 1, 2, L, L]
        mask_bias = mask_bias.masked_fill(mask_bias != 0, fill)
    else:
        mask_bias = mask_bias.clone()
        mask_bias[:, 1:, ..., :70] = fill  # rows n = 1, 2: keys 0-69 masked
    check_against_reference(q, k, v, mask_bias, pair_bias)


# Rows whose every key carries the same finite fill. At -1e9 (a bfloat16 or float32 bias) the fill
# swamps the logits wherever they are formed (q.k and the pair bias fall below an ulp of -1e9 in
# eager's float32 logits and of -1e9 / scale in the kernels' scores), so the keys of such a row tie:
# P = 1 / L exactly as eager has it, whose float32 run is then the exact reference. float16 inputs
# with a float32 -1e9 bias are the case where 2^delta (softmax_step) does not fit the element type:
# the kernels take it out of every exponent there. At -3e4 (a float16 bias) the logits survive in
# float32, so the reference is float64, and only L = 1 is a tie. At L = 1, P = 1 exactly: out = v and
# dv = dO bit for bit in eager, and so in the kernels, whose backward recomputes P from the
# forward's statistics (store_output_rows); dq, dk and the bias gradients are zero there up to the
# ZERO_RMS rule of check_against_reference. (float16 at -3e4 with L > 1 is not a tie but a softmax
# at a large common offset; there the kernels' scores, mask / scale in float32, sit on a coarser
# grid than eager's logits: README, "Backends".)
@gpu
@pytest.mark.parametrize(
    "dtype,fill,mask_dtype,length",
    [
        (torch.bfloat16, -1e9, torch.bfloat16, 1),
        (torch.bfloat16, -1e9, torch.bfloat16, 3),
        (torch.float16, -3e4, torch.float16, 1),
        (torch.float16, -1e9, torch.float32, 1),
        (torch.float16, -1e9, torch.float32, 3),
    ],
    ids=["bf16-L1", "bf16-L3", "fp16-3e4-L1", "fp16-f32mask-L1", "fp16-f32mask-L3"],
)
@pytest.mark.parametrize("head_dim", [32, 40])
@pytest.mark.parametrize("with_pair", [False, True], ids=["mask", "mask+pair"])
def test_rows_masked_by_a_finite_fill_match_eager(dtype, fill, mask_dtype, length, head_dim, with_pair):
    q, k, v, _, pair_bias = make_inputs(2, 3, length, length, 2, head_dim, dtype, "pair" if with_pair else "none",
                                        seed=length + head_dim)
    mask_bias = torch.full((2, 3, 1, 1, length), fill, device="cuda", dtype=mask_dtype)  # every key of every row
    ref_dtype = torch.float32 if fill == -1e9 else torch.float64
    check_against_reference(q, k, v, mask_bias, pair_bias, ref_dtype=ref_dtype)

    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
    fused_out, fused_grads = run("cutlass", q, k, v, mask_bias, pair_bias, dout)
    eager_out, eager_grads = run("eager", q, k, v, mask_bias, pair_bias, dout)
    if length == 1:
        assert torch.equal(eager_out, v) and torch.equal(eager_grads["v"], dout.to(dtype))  # the premise
        assert torch.equal(fused_out, v), f"out - v: {(fused_out.float() - v.float()).abs().max().item():.3e}"
        dv_error = (fused_grads["v"].float() - dout.to(dtype).float()).abs().max().item()
        assert torch.equal(fused_grads["v"], dout.to(dtype)), f"max |dv - dO| = {dv_error:.3e}"
    else:
        # P^T rounds to dtype(1 / L) in both backends: dv = sum_i P dO_i, up to the order of the
        # float32 sums (one ulp)
        torch.testing.assert_close(fused_grads["v"], eager_grads["v"], rtol=torch.finfo(dtype).eps, atol=0.0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [40, 128])
def test_non_contiguous_inputs(dtype, head_dim):
    # q, k, v as views of one packed projection [B, N, L, 3, H, D], plus a transposed layout.
    packed = torch.randn(1, 3, 45, 3, 2, head_dim, device="cuda", dtype=dtype)
    q, k, v = packed.unbind(dim=3)
    assert not q.is_contiguous()
    mask_bias = (1e9 * ((torch.rand(1, 3, 1, 1, 45, device="cuda") > 0.2).float() - 1)).to(dtype)
    pair_bias = torch.randn(1, 1, 45, 45, 2, device="cuda").to(dtype).permute(0, 1, 4, 2, 3)  # keys not contiguous
    check_against_reference(q, k, v, mask_bias, pair_bias)
    q_t = torch.randn(1, 3, 2, 45, head_dim, device="cuda", dtype=dtype).transpose(2, 3)  # [B, N, L, H, D] view
    mask_strided = (1e9 * ((torch.rand(1, 3, 1, 1, 90, device="cuda") > 0.2).float() - 1))[..., ::2]  # key stride 2
    check_against_reference(q_t, k, v, mask_strided, pair_bias)


@gpu
@pytest.mark.parametrize("head_dim", [8, 24, 32])
@pytest.mark.parametrize("layout", ["contiguous", "batch_outer_rows", "one_row", "keys_broadcast_over_rows"])
def test_any_batch_layout(head_dim, layout):
    # The Hopper kernels copy k and v rows by TMA, in boxes D values wide where D is narrower than
    # the bucket (8, 24): batch and row strides of every kind give the reference.
    batch, rows, length, heads = (1, 1, 70, 2) if layout == "one_row" else (2, 3, 70, 2)
    dt = torch.bfloat16

    def make(shape_rows: int = rows) -> torch.Tensor:
        if layout == "batch_outer_rows":  # [N, B, L, H, D] memory seen as [B, N, L, H, D]
            return torch.randn(shape_rows, batch, length, heads, head_dim, device="cuda", dtype=dt).transpose(0, 1)
        return torch.randn(batch, shape_rows, length, heads, head_dim, device="cuda", dtype=dt)

    q, k, v = make(), make(), make()
    if layout == "keys_broadcast_over_rows":
        k, v = (make(1).expand(-1, rows, -1, -1, -1) for _ in range(2))  # stride n = 0
    mask_bias = (1e9 * ((torch.rand(batch, rows, 1, 1, length, device="cuda") > 0.2).float() - 1)).to(dt)
    pair_bias = torch.randn(batch, 1, heads, length, length, device="cuda", dtype=dt)
    check_against_reference(q, k, v, mask_bias, pair_bias)


@gpu
def test_grid_limits_batch_times_rows():
    # B * N > 65535 CTAs along one grid dimension.
    check_against_reference(*make_inputs(2, 33000, 5, 5, 1, 8, torch.bfloat16, "both"))


@gpu
def test_deterministic():
    q, k, v, mask_bias, pair_bias = make_inputs(1, 64, 200, 200, 4, 32, torch.bfloat16, "both")
    dout = torch.randn(q.shape, device="cuda")
    first = run("cutlass", q, k, v, mask_bias, pair_bias, dout)
    for _ in range(3):
        again = run("cutlass", q, k, v, mask_bias, pair_bias, dout)
        assert torch.equal(first[0], again[0])
        for name in first[1]:
            assert torch.equal(first[1][name], again[1][name]), name


@gpu
def test_caller_tensors_untouched():
    inputs = make_inputs(1, 3, 30, 30, 2, 16, torch.bfloat16, "both")
    copies = [t.clone() for t in inputs]
    for t in inputs:
        t.requires_grad_(True)
    ops.evoformer_attention(*inputs, backend="cutlass").float().sum().backward()
    for before, after in zip(copies, inputs):
        assert torch.equal(before, after.detach())


@gpu
@pytest.mark.parametrize(
    "dtype,length",  # the pair bias copied (rows not a multiple of 16 bytes) or read in place
    [(torch.bfloat16, 20), (torch.bfloat16, 24), (torch.float32, 22), (torch.float32, 24)],
)
def test_opcheck(dtype, length):
    # the extension's attention ops against their schemas and fake implementations (shapes, strides
    # and dtypes of the real outputs), traced as torch.compile traces them
    kernels = cutlass._kernels()
    q, k, v, mask_bias, pair_bias = make_inputs(1, 2, length, length, 2, 32, dtype, "both")
    family = cutlass.kernel_family(q.device, dtype)
    assert cutlass.pair_needs_copy(pair_bias) == (length % (16 // pair_bias.element_size()) != 0)
    forward_args = (q, k, v, mask_bias, pair_bias, 0.25, family)
    torch.library.opcheck(kernels.forward.default, forward_args)
    out, stats, mask_prepared, pair_prepared = kernels.forward(*forward_args)
    args = (torch.randn_like(out), q, k, v, out, stats, mask_prepared, pair_bias, pair_prepared, 0.25, family,
            mask_bias.dtype, True)
    torch.library.opcheck(kernels.backward.default, args)


@gpu
def test_auto_falls_back_for_unsupported_inputs():
    q64 = torch.randn(1, 2, 10, 2, 16, device="cuda", dtype=torch.float64)  # float64: not supported by cutlass
    with pytest.raises(ValueError, match="float64"):
        ops.evoformer_attention(q64, q64, q64, backend="cutlass")
    out = ops.evoformer_attention(q64, q64, q64, backend="auto")
    assert out.dtype == torch.float64
    big_d = torch.randn(1, 2, 10, 1, 136, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim"):
        ops.evoformer_attention(big_d, big_d, big_d, backend="cutlass")
    assert ops.get_backend("cutlass").not_supported_reasons(ops.validate(big_d, big_d, big_d))


# A GPU whose shared memory per block is below what some kernels take (compute capability 8.6 and 8.9
# allow 101,376 bytes; the portable kernels take up to 156 KB): the cutlass backend refuses those
# inputs with the sizes in its reason, and `auto` runs them eager. The device's limit is lowered here
# to the D = 32 kernels' own need.
@gpu
def test_kernels_beyond_the_devices_shared_memory_fall_back(monkeypatch):
    from evoformer_blocks.ops import _dispatch

    bf16 = torch.bfloat16
    family = cutlass.kernel_family(torch.device("cuda"), bf16)
    small = cutlass.smem_needed(family, bf16, 32, bf16)
    big = cutlass.smem_needed(family, bf16, 128, None)
    assert 0 < small < big
    if family == "sm80":  # what runs on GPUs of compute capability 8.6 and 8.9 (README, Backends)
        assert small <= 101376 < big
    monkeypatch.setitem(cutlass._smem_allowed, torch.cuda.current_device(), small)
    with _dispatch.REGISTRY.isolated():
        _dispatch.REGISTRY._state.selected.clear()
        _dispatch.REGISTRY._state.decisions.clear()
        q, k, v, mask_bias, pair_bias = make_inputs(1, 2, 40, 40, 2, 32, bf16, "both")
        assert not ops.get_backend("cutlass").not_supported_reasons(ops.validate(q, k, v, mask_bias, pair_bias))
        q, k, v, mask_bias, _ = make_inputs(1, 2, 40, 40, 2, 128, bf16, "mask")
        reasons = ops.get_backend("cutlass").not_supported_reasons(ops.validate(q, k, v, mask_bias))
        assert any(f"take {big} bytes of shared memory per block" in r and f"allows {small}" in r for r in reasons)
        with pytest.raises(ValueError, match="shared memory per block"):
            ops.evoformer_attention(q, k, v, mask_bias, backend="cutlass")
        out = ops.evoformer_attention(q, k, v, mask_bias, backend="auto")
        assert torch.equal(out, ops.evoformer_attention(q, k, v, mask_bias, backend="eager"))


@gpu
def test_compile_fullgraph():
    torch._dynamo.reset()  # a graph compiled under another kernel-family setting would be reused
    q, k, v, mask_bias, pair_bias = make_inputs(1, 2, 24, 24, 2, 32, torch.bfloat16, "both")
    q.requires_grad_(True)

    def fn(q, k, v, m, p):
        return ops.evoformer_attention(q, k, v, m, p, backend="cutlass") * 2

    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, v, mask_bias, pair_bias)
    out.float().sum().backward()
    expected = fn(q.detach(), k, v, mask_bias, pair_bias)
    assert torch.equal(out.detach(), expected)
    assert q.grad is not None and torch.isfinite(q.grad).all()


@gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    # q, k, v of 2.3e9 elements each: offsets past 2^31 must use 64-bit arithmetic.
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    rows = 2**31 // (64 * 32) + 4096
    q, k, v, mask_bias, pair_bias = make_inputs(1, rows, 64, 64, 1, 32, torch.bfloat16, "both", masked_frac=0.1)
    assert q.numel() > 2**31
    leaves = [t.requires_grad_(True) for t in (q, k, v, pair_bias)]
    out = ops.evoformer_attention(q, k, v, mask_bias, pair_bias, backend="cutlass")
    dout = torch.randn_like(out)
    out.backward(dout)
    tail = slice(rows - 3, rows)
    sub = [t.detach()[:, tail] for t in (q, k, v)]
    sub_leaves = [t.clone().requires_grad_(True) for t in sub]
    ref = ops.evoformer_attention(*sub_leaves, mask_bias[:, tail], pair_bias.detach(), backend="eager")
    ref.backward(dout[:, tail])
    assert rel_error(out[:, tail], ref) < 2e-2
    for leaf, sub_leaf in zip(leaves[:3], sub_leaves):
        assert rel_error(leaf.grad[:, tail], sub_leaf.grad) < 3e-2


PORTABLE_APART_CASE = """
import torch
from evoformer_blocks.ops import _build
name = _build.load()  # the core library only
ops = getattr(torch.ops, _build.OP_NAMESPACE)
q = torch.randn(1, 2, 40, 2, 32, device="cuda", dtype=torch.bfloat16)
for call in (lambda: ops.forward(q, q, q, None, None, 0.25, "sm80"), lambda: ops.attach_portable_kernels("/nonexistent.so")):
    try:
        call()
        print("no error")
    except RuntimeError as exc:
        print(str(exc).splitlines()[0])
ops.forward(q.float(), q.float(), q.float(), None, None, 0.25, "sm80")  # float32 (TF32) kernels: the core's
torch.cuda.synchronize()
print("float32 ok")
"""


@gpu
def test_portable_16bit_kernels_apart_load_on_first_use():
    # A Hopper-only build keeps the portable 16-bit kernels in a second library: a fresh process that
    # asks the core library for them before it is attached gets a clear error, a bad path another;
    # through evoformer_blocks (kernel_family) it builds, attaches and runs them.
    if not _build.portable_apart(_build.arch_list()):
        pytest.skip("this build holds the portable kernels itself")
    result = subprocess.run([sys.executable, "-c", PORTABLE_APART_CASE], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 3, result.stdout + result.stderr[-4000:]
    assert "portable (sm80) 16-bit kernels in a library built on first use, and it is not loaded" in lines[0]
    assert "cannot open the portable kernels' library `/nonexistent.so`" in lines[1]
    assert lines[2] == "float32 ok"
    assert _build.load_portable() is not None
    assert _build.status()["portable"].split(": ")[1] == "built"
    q = torch.randn(1, 2, 40, 2, 32, device="cuda", dtype=torch.float16)
    out, *_ = getattr(torch.ops, _build.OP_NAMESPACE).forward(q, q, q, None, None, 0.25, "sm80")
    scores = torch.einsum("bnqhd,bnkhd->bnhqk", q.float(), q.float()) * 0.25  # [B, N, H, Lq, Lk]
    expected = torch.einsum("bnhqk,bnkhd->bnqhd", torch.softmax(scores, dim=-1), q.float())  # [B, N, L, H, D]
    assert (out.float() - expected).abs().max().item() < 1e-2


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool):
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer not on PATH")
    script = Path(__file__).with_name("sanitizer_case.py")
    result = subprocess.run(
        [sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    summary = {"memcheck": "ERROR SUMMARY: 0 errors", "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors"}
    assert summary[tool] in output, output[-4000:]
