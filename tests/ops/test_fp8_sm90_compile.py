"""The FP8 kernels compile for sm_90 on a machine without a GPU (Triton's own ptxas), in a
fresh process (the kernel tests import them under TRITON_INTERPRET=1), with what their speed
rests on: the e4m3 bytes read by 16-byte vector loads (or 16-byte cp.async copies where a loop
is pipelined) once pointers and sizes are multiples of
16 (the divisibility the launcher specializes on, given here as attributes), decoded by
Hopper's conversion instruction, the tensor-core GEMV config on float16 wgmma, and the
activation quantization's codes (its own kernel's, and the norm's that quantizes its output)
written by the packed float32 -> e4m3 convert."""

from __future__ import annotations

import re

import pytest

from muser.ops.triton import gemv_fp8

from sm90 import GDC, compile_ptx

COMPILE = r'''
gemv_fp8 = importlib.import_module("muser.ops.triton.gemv_fp8")
dequantize_fp8 = importlib.import_module("muser.ops.triton.dequantize_fp8")
quantize_fp8 = importlib.import_module("muser.ops.triton.quantize_fp8")
SIXTEEN = ("K", "M", "k_per_split", "stride_xn")  # as the launcher specializes them

types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16",
         "part_ptr": "*fp32", "cnt_ptr": "*i32", "res_ptr": "*fp32", "post_ptr": "*fp32",
         "next_ptr": "*fp32", "res_out_ptr": "*fp32", "eps": "fp32"}
out = {}
for kind, block_n, block_m, block_k, stages, epilogue in [
        ("fma", 1, 8, 1024, 3, "norm"), ("fma", 8, 4, 1024, 3, "geglu"),
        ("dot", 16, 128, 128, 4, "norm"), ("dot8", 16, 128, 128, 4, "plain"),
        ("row", 1, 8, 512, 1, "plain"), ("row", 1, 16, 1024, 3, "geglu"),
        ("row", 1, 32, 256, 5, "norm")]:
    for pdl in (True, False):
        out[f"gemv {kind} {epilogue} stages={stages} tile={block_m}x{block_k} pdl={pdl}"] = ptx(
            gemv_fp8._gemv_fp8_kernel, types, dict(
                LOOP=gemv_fp8.LOOPS[kind], SCALE_X=True, GEGLU=epilogue == "geglu", NORM=epilogue == "norm", NORM_BLOCK=2048,
                BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=4,
                ROW_STAGES=stages if kind == "row" else 1,
                ROW_AHEAD=gemv_fp8.AHEAD if kind == "row" else 1, PDL=pdl),
            sixteen=SIXTEEN, num_stages=stages)
out["dequantize"] = ptx(dequantize_fp8._dequantize_fp8_kernel,
                        {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16"},
                        dict(BLOCK_M=32, BLOCK_K=256), sixteen=SIXTEEN)
out["quantize amax"] = ptx(quantize_fp8._block_amax_kernel,
                           {"x_ptr": "*bf16", "amax_ptr": "*fp32"}, dict(BLOCK=1024),
                           sixteen=SIXTEEN)
out["quantize blocks"] = ptx(quantize_fp8._quantize_blocks_kernel,
                             {"x_ptr": "*bf16", "amax_ptr": "*fp32", "data_ptr": "*fp8e4nv",
                              "scales_ptr": "*fp32", "tiny": "fp32"},
                             dict(BLOCK=1024, BLOCKS=32), sixteen=SIXTEEN)
norm = importlib.import_module("muser.ops.triton.norm")
out["quantize in the norm"] = ptx(norm._add_rms_norm_kernel, {
    "res_ptr": "*fp32", "x_ptr": "*bf16", "post_ptr": "*fp32", "next_ptr": "*fp32",
    "res_out_ptr": "*fp32", "out_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32",
    "eps": "fp32", "tiny": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK_D=8192, QUANTIZE=True,
                                         PDL=False), num_warps=8)
geglu = importlib.import_module("muser.ops.triton.geglu")
out["geglu amax"] = ptx(geglu._geglu_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16",
                                              "amax_ptr": "*fp32"},
                        dict(BLOCK=1024, AMAX=True, PDL=False))
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compile_ptx(COMPILE)


def test_every_variant_compiled(ptx):
    assert len(ptx) == 19


def test_row_loop_keeps_the_weight_tile_in_its_load_layout(ptx):
    """The one-row loop never moves codes through shared memory in pieces (the 3-d loop's
    layout conversion did, 16 bits at a time); with stages it loads tiles ahead by cp.async."""
    rows = {name: code for name, code in ptx.items() if " row " in name}
    assert len(rows) == 6
    for name, code in rows.items():
        assert not any(f"st.shared.{t}" in code for t in ("b8", "u8", "b16", "u16")), name
        assert ("cp.async.cg.shared.global" in code) == ("stages=1" not in name), name
        assert "ld.global.b8" not in code and "ld.global.u8" not in code, name


def test_row_loop_loads_its_first_weight_tiles_before_the_wait(ptx):
    """With programmatic launch, the row loop's first AHEAD tiles of codes are loaded (16 bytes
    a load) before griddepcontrol.wait, while the kernel before it finishes; nothing else is
    read before the wait (x is an earlier kernel's output)."""
    for name, code in ptx.items():
        if " row " not in name or "pdl=True" not in name:
            continue
        before = code[:code.index("griddepcontrol.wait")]
        loads = re.findall(r"ld\.global[.\w]*", before)
        block_m, block_k = map(int, re.search(r"tile=(\d+)x(\d+)", name).groups())
        per_tile = block_m * block_k // (4 * 32 * 16)  # 16 codes a load, four warps
        assert len(loads) == gemv_fp8.AHEAD * per_tile and all(".v4." in op for op in loads), (name, loads)


def test_fp8_bytes_vector_loaded_and_decoded_in_hardware(ptx):
    for name, code in ptx.items():
        if not name.startswith(("gemv", "dequantize")):  # activations: no e4m3 bytes read
            continue
        # 16 bytes at a time: into registers, or into shared memory by cp.async (pipelined)
        assert ("ld.global.v4.b32" in code or "ld.global.cg.v4.b32" in code
                or re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", code)), name
        assert "ld.global.b8" not in code and "ld.global.u8" not in code, name
        if "dot8" not in name:  # dot8 multiplies the codes as they are
            assert "cvt.rn.f16x2.e4m3x2" in code, name


def test_tensor_core_gemv_on_wgmma_and_pdl_only_when_asked(ptx):
    for name, code in ptx.items():
        if " dot " in name:  # float16 operands: the codes widened by one packed convert
            assert "wgmma.mma_async" in code and ".f16.f16" in code, name
        if "dot8" in name:  # e4m3 operands, x's codes made in registers
            assert "wgmma.mma_async" in code and ".e4m3.e4m3" in code, name
            assert "cvt.rn.satfinite.e4m3x2.f32" in code, name
        if name.startswith("gemv"):
            assert all((g in code) == ("pdl=True" in name) for g in GDC), name


def test_activation_codes_converted_in_hardware(ptx):
    """The codes written by the packed float32 -> e4m3 convert (the quantization kernel and
    the norm that quantizes its output); the two maxima kernels write float32 only."""
    for name in ("quantize blocks", "quantize in the norm"):
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx[name], name
    for name in ("quantize amax", "geglu amax"):
        assert "e4m3" not in ptx[name], name
