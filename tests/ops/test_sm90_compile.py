"""The Hopper-only path (programmatic dependent launch) compiles for sm_90 on a machine without
a GPU, with the ptxas Triton ships: the interpreter never runs it, so this is where a PTX error
in it shows before a device run. Compiled in a fresh process, since the kernel tests import the
kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import re

import pytest

from sm90 import GDC, compile_ptx

COMPILE = r'''
from gguf import GGMLQuantizationType
from muser.ops.blocks import KERNEL_TYPES
# NOTE: modules, not the ops of the same names that muser.ops.triton exports
gemv = importlib.import_module("muser.ops.triton.gemv")
decode_attention = importlib.import_module("muser.ops.triton.decode_attention")
gemm = importlib.import_module("muser.ops.triton.gemm")
prefill = importlib.import_module("muser.ops.triton.prefill_attention")
softmax = importlib.import_module("muser.ops.triton.softmax")
qk_norm_rope = importlib.import_module("muser.ops.triton.qk_norm_rope")
stage_gather = importlib.import_module("muser.ops.triton.stage_gather")
store_kv = importlib.import_module("muser.ops.triton.store_kv")

gemv_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*bf16",
              "part_ptr": "*fp32", "cnt_ptr": "*i32", "res_ptr": "*fp32", "post_ptr": "*fp32", "next_ptr": "*fp32",
              "res_out_ptr": "*fp32", "eps": "fp32"}
out = {}
for name, block_n, block_m, block_k, stages in [("fma", 1, 8, 512, 3), ("dot", 16, 128, 128, 4)]:
    kernel = getattr(gemv, f"_gemv_{name}_kernel")
    for pdl in (True, False):
        out[f"gemv {name} pdl={pdl}"] = ptx(kernel, gemv_types, dict(
            GEGLU=False, NORM=True, NORM_BLOCK=2048, BLOCK_N=block_n, BLOCK_M=block_m,
            BLOCK_K=block_k, SPLIT_K=4, SCALED=0, PDL=pdl), num_stages=stages)
for epilogue in ("geglu", "norm"):
    out[f"gemm {epilogue} pdl=True"] = ptx(gemm._gemm_kernel, gemv_types, dict(
        GEGLU=epilogue == "geglu", NORM=epilogue == "norm", NORM_ROWS=4, NORM_BLOCK=1024,
        BLOCK_N=128, BLOCK_M=128, BLOCK_K=64, CUTS=False, SCALED=0, PDL=True), num_warps=8,
        num_stages=3)
out["gemm exact pdl=True"] = ptx(gemm._gemm_kernel, gemv_types, dict(
    GEGLU=True, NORM=False, NORM_ROWS=4, NORM_BLOCK=1024, BLOCK_N=128, BLOCK_M=128, BLOCK_K=64,
    CUTS=True, SCALED=0, PDL=True), num_warps=8, num_stages=3)
# FP8 codes on the exact route (SCALED_BF16): decode GEMV and prefill GEMM
fp8 = gemv_types | {"w_ptr": "*u8"}  # e4m3 codes read as bytes
out["fp8 exact gemv dot pdl=True"] = ptx(gemv._gemv_dot_kernel, fp8, dict(
    GEGLU=True, NORM=False, NORM_BLOCK=2048, BLOCK_N=16, BLOCK_M=64, BLOCK_K=256, SPLIT_K=4,
    SCALED=1, PDL=True), num_stages=4)
out["gemm exact fp8 pdl=True"] = ptx(gemm._gemm_kernel, fp8, dict(
    GEGLU=False, NORM=False, NORM_ROWS=4, NORM_BLOCK=1024, BLOCK_N=128, BLOCK_M=128,
    BLOCK_K=64, CUTS=True, SCALED=1, PDL=True), num_warps=8, num_stages=3)
# the exact route's decode GEMV over GGUF blocks: each type's tile dequantized in registers
blocks_dot = importlib.import_module("muser.ops.triton.gemv_blocks_dot")
block_types = {"x_ptr": "*bf16", "w_ptr": "*u8", "d_ptr": "*fp16", "out_ptr": "*bf16",
               "part_ptr": "*fp32", "cnt_ptr": "*i32"}
for qtype in KERNEL_TYPES:
    for geglu in (False, True) if qtype.name == "Q4_K" else (False,):
        out[f"block dot {qtype.name} geglu={geglu} pdl=True"] = ptx(
            blocks_dot._gemv_blocks_dot_kernel, block_types, dict(
                QTYPE=int(qtype), GEGLU=geglu, BLOCK_N=16, BLOCK_M=64, BLOCK_K=128, SPLIT_K=4,
                PDL=True), num_stages=3)
exact_attn = {"q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "kn_ptr": "*bf16",
              "vn_ptr": "*bf16", "src_ptr": "*i32", "dst_ptr": "*i32", "table_ptr": "*i32",
              "starts_ptr": "*i32", "lens_ptr": "*i32", "origins_ptr": "*i32",
              "mid_o": "*fp32", "mid_ml": "*fp32", "scale_log2": "fp32", "rows_ptr": "*i64",
              "o_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16"}
for dim, group, kv_heads in ((256, 4, 1), (128, 2, 16)):  # gemma3-1b's heads, gemma3-27b's
    warps = softmax.exact_warps(dim)
    out[f"attention exact {dim} pdl=True"] = ptx(
        decode_attention._decode_span_kernel, exact_attn, dict(
            KVH=kv_heads, G=group, BLOCK_G=16, D=dim, BLOCK_N=softmax.KEY_TILE,
            SPAN=softmax.SPAN, SPLITS=8, NEW=True, ONE_BLOCK=False, FP8=False, DOT=1, PDL=True),
        num_warps=4, num_stages=2)
    for split in (False, True):
        out[f"exact prefill attention {dim} split={split}"] = ptx(
            prefill._flash_exact_kernel, exact_attn, dict(
                G=group, D=dim, BLOCK=softmax.KEY_TILE, SPAN=softmax.SPAN, HAS_WINDOW=split,
                INDEXED=not split, PACK=1, SPLIT=split, FP8=False, DOT=1), num_warps=warps,
            num_stages=2)
    # an FP8 cache (muser/ops/kv_fp8.py): packed uint8 rows, the new keys float32, bf16 dots
    fp8 = exact_attn | {"k_ptr": "*u8", "v_ptr": "*u8", "kn_ptr": "*fp32"}
    out[f"attention exact fp8 {dim} pdl=True"] = ptx(
        decode_attention._decode_span_kernel, fp8, dict(
            KVH=kv_heads, G=group, BLOCK_G=16, D=dim, BLOCK_N=softmax.KEY_TILE,
            SPAN=softmax.SPAN, SPLITS=8, NEW=True, ONE_BLOCK=False, FP8=True, DOT=1, PDL=True),
        num_warps=4, num_stages=2)
    for split in (False, True):
        out[f"fp8 exact prefill attention {dim} split={split}"] = ptx(
            prefill._flash_exact_kernel, fp8, dict(
                G=group, D=dim, BLOCK=softmax.KEY_TILE, SPAN=softmax.SPAN, HAS_WINDOW=split,
                INDEXED=not split, PACK=1, SPLIT=split, FP8=True, DOT=1), num_warps=warps,
            num_stages=2)
# the FP8 cache's stores: gemma3-27b's rows (16 KV heads of 128)
rows = {"k_rows": "*u8", "v_rows": "*u8", "src_ptr": "*i32", "dst_ptr": "*i32"}
out["fp8 store_kv"] = ptx(store_kv._store_kv_fp8_kernel, rows | {
    "k_new": "*fp32", "v_new": "*bf16"}, dict(KVH=16, BLOCK_H=16, D=128))
out["fp8 stage_gather"] = ptx(stage_gather._stage_gather_kernel, rows | {
    "read_ptr": "*i64", "k_new": "*fp32", "v_new": "*bf16", "k_out": "*u8", "v_out": "*u8"},
    dict(ROW=16 * 132, BLOCK=4096, FP8=True, KVH=16, BLOCK_H=16, D=128))
out["fp8 qk pair store"] = ptx(qk_norm_rope._qk_pair_kernel, rows | {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "q_out": "*fp32", "k_out": "*fp32", "v_ptr": "*bf16", "eps": "fp32"},
    dict(HALF=64, HEADS=8, STORE=True, FP8=True, PDL=False))
attn_types = {"q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "kn_ptr": "*fp32",
              "vn_ptr": "*bf16", "src_ptr": "*i32", "dst_ptr": "*i32", "table_ptr": "*i32",
              "starts_ptr": "*i32", "lens_ptr": "*i32", "origins_ptr": "*i32",
              "mid_o": "*fp32", "mid_ml": "*fp32", "qw_ptr": "*fp32", "kw_ptr": "*fp32",
              "cos_ptr": "*fp32", "sin_ptr": "*fp32", "scale_log2": "fp32", "eps": "fp32"}
out["attention pdl=True"] = ptx(decode_attention._decode_split_kernel, attn_types,
    dict(KVH=1, G=4, BLOCK_G=16, D=256, BLOCK_N=32, SPLITS=32, NEW=True, NORM=False,
         PDL=True))
out["attention norm pdl=True"] = ptx(decode_attention._decode_split_kernel,
    attn_types | {"kn_ptr": "*bf16", "q_ptr": "*bf16"},
    dict(KVH=16, G=2, BLOCK_G=16, D=128, BLOCK_N=32, SPLITS=32, NEW=True, NORM=True,
         PDL=True))
flash_types = {"q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "rows_ptr": "*i64",
               "o_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", "tiles_ptr": "*i8",
               "ranges_ptr": "*i32", "scale_log2": "fp32"}
out["prefill attention in place"] = ptx(prefill._flash_kernel, flash_types,
    dict(G=2, D=128, BLOCK=64, HAS_WINDOW=False, INDEXED=True, PACK=2, WIDE=2, DOT=1),
    num_warps=8, num_stages=5)
out["prefill attention combine"] = ptx(prefill._combine_kernel, flash_types | {"o_ptr": "*bf16"},
    dict(D=128), num_warps=1)
# a float32 model (or KV cache): its operands as they are
f32 = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "k_ptr": "*fp32",
       "v_ptr": "*fp32", "kn_ptr": "*fp32", "vn_ptr": "*fp32", "o_ptr": "*fp32"}
out["float32 gemv dot"] = ptx(gemv._gemv_dot_kernel, gemv_types | f32, dict(
    GEGLU=False, NORM=False, NORM_BLOCK=2048, BLOCK_N=16, BLOCK_M=64, BLOCK_K=64, SPLIT_K=1,
    SCALED=0, PDL=False), num_stages=2)
out["float32 gemm"] = ptx(gemm._gemm_kernel, gemv_types | f32, dict(
    GEGLU=False, NORM=False, NORM_ROWS=4, NORM_BLOCK=1024, BLOCK_N=64, BLOCK_M=64, BLOCK_K=32,
    CUTS=False, SCALED=0, PDL=False), num_warps=4, num_stages=2)
out["float32 attention"] = ptx(decode_attention._decode_split_kernel, attn_types | f32,
    dict(KVH=1, G=4, BLOCK_G=16, D=256, BLOCK_N=32, SPLITS=32, NEW=True, NORM=False,
         PDL=False))
out["float32 prefill attention"] = ptx(prefill._flash_kernel, flash_types | f32,
    dict(G=1, D=128, BLOCK=64, HAS_WINDOW=False, INDEXED=True, PACK=1, WIDE=1, DOT=0),
    num_warps=4, num_stages=3)
out["float32 block dot"] = ptx(blocks_dot._gemv_blocks_dot_kernel, block_types | f32, dict(
    QTYPE=int(GGMLQuantizationType.Q4_K), GEGLU=False, BLOCK_N=16, BLOCK_M=64, BLOCK_K=64, SPLIT_K=2,
    PDL=False), num_stages=2)
json.dump(out, sys.stdout)
'''


# Shared memory of the flash kernel at the launch rule's own float32 configs: gemma3-27b's head
# width on contiguous keys (its largest: 180,480 bytes; in place 114,952) and -1b's in place (one
# stage: 147,712 either way); ~70 s to compile on two cores
SHARED = r'''
prefill = importlib.import_module("muser.ops.triton.prefill_attention")
types = {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "rows_ptr": "*i64",
         "o_ptr": "*fp32", "part_ptr": "*fp32", "ml_ptr": "*fp32", "tiles_ptr": "*i8",
         "ranges_ptr": "*i32", "scale_log2": "fp32"}
out = {}
for name, heads, kv_heads, dim, in_place in (("27b", 32, 16, 128, False),
                                             ("1b", 4, 1, 256, True)):
    c = prefill.launch_config(8, heads, kv_heads, 64, dim, 64, in_place, 4)
    out[f"{name} in_place={in_place}"] = compiled(prefill._flash_kernel, types, dict(
        G=heads // kv_heads, D=dim, BLOCK=64, HAS_WINDOW=False, INDEXED=in_place, PACK=c.pack,
        WIDE=c.wide, DOT=0), num_warps=c.num_warps, num_stages=c.num_stages).metadata.shared
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compile_ptx(COMPILE)


def test_float32_prefill_attention_fits_shared_memory():
    """The launch rule's float32 configs compile to what an SM's shared memory holds (its
    count of the buffers is an upper bound: prefill_attention.shared_bytes)."""
    from muser.ops.triton.prefill_attention import SHARED as LIMIT

    shared = compile_ptx(SHARED)
    assert len(shared) == 2
    assert all(0 < v <= LIMIT for v in shared.values()), shared


def test_every_variant_compiled(ptx):
    assert len(ptx) == 32 + 7 + 1


def _tensor_core_instructions(code: str) -> set[str]:
    return set(re.findall(r"wgmma\.mma_async[\w.]*|mma\.sync[\w.]*", code))


@pytest.mark.parametrize("fp8", ["", "fp8 "])
@pytest.mark.parametrize("dim", [256, 128])
def test_exact_attention_sums_on_bf16_tensor_cores_only(ptx, dim, fp8):
    """The exact route's decode programs (16 rows: mma.sync) and prefill programs (64 rows:
    wgmma) sum every dot on bf16 tensor cores into float32, whose chains give the same bits
    whatever the instruction (bench/results/exact_probe_h100.json). Over an FP8 cache too: its
    codes are widened to bf16 first, never multiplied as e4m3 (whose chains differ between
    mma.sync and wgmma)."""
    names = [f"attention exact {fp8}{dim} pdl=True"] + [
        f"{fp8}exact prefill attention {dim} split={split}" for split in (False, True)]
    for name in names:
        found = _tensor_core_instructions(ptx[name])
        assert found and all("f32.bf16.bf16" in i for i in found), (name, found)
    assert any(i.startswith("mma.sync") for i in _tensor_core_instructions(ptx[names[0]]))


def test_fp8_weights_on_the_exact_route_multiply_as_bf16(ptx):
    """FP8 codes on the exact route are bf16 values on bf16 tensor cores (the chain the bf16
    weights' route sums), never e4m3 instructions, whose sums differ between mma.sync and
    wgmma (bench/results/exact_probe_h100.json)."""
    for name in ("fp8 exact gemv dot pdl=True", "gemm exact fp8 pdl=True"):
        found = _tensor_core_instructions(ptx[name])
        assert found and all("f32.bf16.bf16" in i for i in found), (name, found)


def test_exact_block_gemv_sums_on_bf16_tensor_cores(ptx):
    """The exact route's decode GEMV over GGUF blocks (every type the kernels read) feeds its
    tiles, dequantized in registers and rounded to bfloat16 (the workspace's values), to
    bf16 tensor cores summing into float32: the chain of the dense route's dot kinds."""
    names = [name for name in ptx if name.startswith("block dot")]
    assert len(names) == 7
    for name in names:
        found = _tensor_core_instructions(ptx[name])
        assert found and all("f32.bf16.bf16" in i for i in found), (name, found)
        assert "cvt.rn.bf16" in ptx[name], name


def test_float32_operands_multiply_in_float32(ptx):
    """float32 operands (a float32 model or KV cache) multiply in IEEE float32, not in TF32
    (Triton's default for them: 10-bit mantissas, past the float32 bounds the kernel tests
    hold); 16-bit ones keep their tensor cores (the tests above)."""
    for name, code in ptx.items():
        assert "tf32" not in code, name
    assert sum(name.startswith("float32") for name in ptx) == 5


def test_prefill_gemm_runs_on_hopper_tensor_cores(ptx):
    for name, code in ptx.items():
        if name.startswith("gemm"):
            assert "wgmma.mma_async" in code, name


def test_prefill_attention_runs_on_hopper_tensor_cores(ptx):
    assert "wgmma.mma_async" in ptx["prefill attention in place"]


def test_pdl_waits_and_releases_only_when_asked(ptx):
    for name, code in ptx.items():
        pdl = "pdl=True" in name
        assert all((g in code) == pdl for g in GDC), name


def test_the_wait_comes_before_every_store_and_the_loads_of_the_kernel_before(ptx):
    """Nothing is written before the wait. Reads before it are the ones pdl.py allows: the
    decode split (with the step's new row) reads its metadata and its first tile of cached
    keys there, which no kernel of this step writes (and with norm_rope the norms' weights and
    the rows' cos, sin); the others read nothing before it."""
    for name, code in ptx.items():
        if "pdl=True" in name:
            wait = code.index(GDC[0])
            assert wait < code.index("st.global"), name
            prefetches = name.startswith("attention")
            assert (code.index("ld.global") < wait) == prefetches, name

