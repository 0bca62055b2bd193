"""The GGUF block kernels (decode GEMV over blocks, x as int8 rows for it, dequantization into
the workspace) compile for sm_90 on a machine without a GPU, at the dtypes the GPU runs
(bfloat16 activations and workspace, which the interpreter computes wrongly), with and
without programmatic dependent launch: as test_sm90_compile.py, in a fresh process, with the
ptxas Triton ships. The integer dot products (every type's) are PTX's dp4a there (the
interpreter runs their arithmetic instead)."""

from __future__ import annotations

import pytest

from muser.ops.blocks import KERNEL_TYPES

from sm90 import GDC, compile_ptx

COMPILE = r'''
from muser.ops.blocks import KERNEL_TYPES
# NOTE: modules, not the ops of the same names that muser.ops.triton exports
gemv_blocks = importlib.import_module("muser.ops.triton.gemv_blocks")
dequantize_blocks = importlib.import_module("muser.ops.triton.dequantize_blocks")
int8_rows = importlib.import_module("muser.ops.triton.int8_rows")

types = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
         "cnt_ptr": "*i32", "d_ptr": "*fp16", "xh_ptr": "*i32", "xl_ptr": "*i32",
         "xs_ptr": "*fp32", "xsum_ptr": "*i32", "xhalf_ptr": "*i32", "like_ptr": "*bf16",
         "res_ptr": "*fp32", "post_ptr": "*fp32", "next_ptr": "*fp32", "res_out_ptr": "*fp32",
         "eps": "fp32"}
out = {}
for qtype in KERNEL_TYPES:
    words = {"w_ptr": "*i16" if qtype.name in ("Q4_0", "Q5_0") else "*i32", "wd_ptr": "*fp16"}
    # split over K: the partials and the last arriver; the epilogues: GeGLU, add + RMSNorm
    for pdl, split, epilogue in ((True, 1, ""), (False, 4, ""), (True, 2, "GEGLU"),
                                 (True, 2, "NORM")):
        c = gemv_blocks.default_config(8, 4096, 4096, qtype)
        out[f"gemv {qtype.name} pdl={pdl} split={split} {epilogue}"] = ptx(
            gemv_blocks._gemv_blocks_kernel, types | words, dict(
                QTYPE=int(qtype), BLOCK_N=8, BLOCK_M=c.block_m, BLOCKS=c.blocks, SPLIT_K=split,
                GEGLU=epilogue == "GEGLU", NORM=epilogue == "NORM", NORM_BLOCK=4096, ASM=True,
                PDL=pdl), num_warps=c.num_warps)
    out[f"dequantize {qtype.name} pdl=True"] = ptx(
        dequantize_blocks._dequantize_blocks_kernel, types,
        dict(QTYPE=int(qtype), BLOCK_M=16, BLOCK_K=256, PDL=True))
for pdl in (True, False):
    out[f"int8_rows pdl={pdl}"] = ptx(int8_rows._int8_rows_kernel, types | {
        "hi_ptr": "*i32", "lo_ptr": "*i32", "scale_ptr": "*fp32", "sums_ptr": "*i32",
        "half_ptr": "*i32"}, dict(GROUPS=int8_rows.GROUPS, PDL=pdl))
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compile_ptx(COMPILE)


def test_every_variant_compiled(ptx):
    assert len(ptx) == 5 * len(KERNEL_TYPES) + 2


def test_pdl_waits_and_releases_only_when_asked(ptx):
    for name, code in ptx.items():
        pdl = "pdl=True" in name
        assert all((g in code) == pdl for g in GDC), name


def test_integer_dot_in_dp4a(ptx):
    """Every type sums codes times x's int8 levels four at a time in dp4a (Q4_K's high nibbles
    in place, as unsigned bytes), no float FMA per weight."""
    for name, code in ptx.items():
        if name.startswith("gemv"):
            assert "dp4a.s32.s32" in code, name
            assert ("dp4a.u32.s32" in code) == ("Q4_K" in name), name


def test_bfloat16_stored(ptx):
    """The outputs are rounded to bfloat16 in the kernel (cvt to bf16), not stored as float32."""
    for name, code in ptx.items():
        if not name.startswith("int8_rows"):
            assert "cvt.rn.bf16" in code, name
