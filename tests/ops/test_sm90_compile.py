"""The Hopper-only path (programmatic dependent launch) compiles for sm_90 on a machine without
a GPU, with the ptxas Triton ships: the interpreter never runs it, so this is where a PTX error
in it shows before a device run. Compiled in a fresh process, since the kernel tests import the
kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest

from sm90 import GDC, compile_ptx

COMPILE = r'''
# NOTE: modules, not the ops of the same names that muser.ops.triton exports
gemv = importlib.import_module("muser.ops.triton.gemv")
decode_attention = importlib.import_module("muser.ops.triton.decode_attention")
gemm = importlib.import_module("muser.ops.triton.gemm")
prefill = importlib.import_module("muser.ops.triton.prefill_attention")

gemv_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
              "cnt_ptr": "*i32", "res_ptr": "*fp32", "post_ptr": "*fp32", "next_ptr": "*fp32",
              "res_out_ptr": "*fp32", "eps": "fp32"}
out = {}
for name, block_n, block_m, block_k, stages in [("fma", 1, 8, 512, 3), ("dot", 16, 128, 128, 4)]:
    kernel = getattr(gemv, f"_gemv_{name}_kernel")
    for pdl in (True, False):
        out[f"gemv {name} pdl={pdl}"] = ptx(kernel, gemv_types, dict(
            GEGLU=False, NORM=True, NORM_BLOCK=2048, BLOCK_N=block_n, BLOCK_M=block_m,
            BLOCK_K=block_k, SPLIT_K=4, PDL=pdl), num_stages=stages)
for epilogue in ("geglu", "norm"):
    out[f"gemm {epilogue} pdl=True"] = ptx(gemm._gemm_kernel, gemv_types, dict(
        GEGLU=epilogue == "geglu", NORM=epilogue == "norm", NORM_ROWS=4, NORM_BLOCK=1024,
        BLOCK_N=128, BLOCK_M=128, BLOCK_K=64, PDL=True), num_warps=8, num_stages=3)
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
    dict(G=2, D=128, BLOCK=64, HAS_WINDOW=False, INDEXED=True, PACK=2, WIDE=2), num_warps=8,
    num_stages=5)
out["prefill attention combine"] = ptx(prefill._combine_kernel, flash_types | {"o_ptr": "*bf16"},
    dict(D=128), num_warps=1)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compile_ptx(COMPILE)


def test_every_variant_compiled(ptx):
    assert len(ptx) == 10


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

