"""Embeddings (LLM.embed; `muser serve --embedding`): a prompt's final hidden states after the
final norm, pooled, against transformers' float32 last_hidden_state of the embedded model
(tests/hf_checkpoint.py: the same dequantized weights, in memory), computed by the engine's own
prefill in chunks past the sliding window; the rows equal a one-chunk prefill's bitwise; the
routes' shapes (OpenAI's through the openai client, llama-server's), normalizations, usage,
metrics and errors over real loopback servers.

Error model (tests/gemma4/test_parity.py's): each float32 op on a hidden state's path is within
ATOL_OP * s + RTOL_OP * |exact| of its exact value, s the scale of the values it makes: a few
roundings of its output and intermediates (8u) and one sum of at most K_MAX terms (gamma_K_MAX),
in any order; K_MAX is the MLP's down projection (intermediate_size terms; attention sums fewer
keys here). Every residual add meets an RMSNorm, so an op passes its input's error on at about
unit gain and the errors add over the path: OPS_PER_LAYER ops a layer (norm, QKV, QK-norm +
RoPE, attention, O + add-norm, gate_up + GeGLU, down + add-norm), the embedding's scale and the
final norm. Measured in units of the row's RMS (s: the final norm leaves each row at the RMS of
its gains), a row's element is within ATOL * rms(row) + RTOL * |exact|; muser and transformers
each sum in their own order, so their distance is within twice one side's bound. Mean pooling
adds a float64 sum and one division (2u); a normalized vector e = m / |m| moves by at most
2 |dm| / |m|. The bound is derived, not measured: these prompts show about 1e-4 of it.
"""

from __future__ import annotations

import base64
import functools
import struct
from pathlib import Path

import openai
import pytest
import torch

from muser import LLM
from muser.cli import build_parser
from muser.errors import MuserError
from muser.server.options import server_options
from tests.error_bounds import U, gamma
from tests.hf_checkpoint import hf_model
from tests.server.conftest import Server, start_server, stop_server

OPS_PER_LAYER = 7
CHUNK = 64  # prefill rows per step in-process: the long prompt takes several, past the window
SHORT = "I believe the meaning of life is"
LONG = ("The quick brown fox jumps over the lazy dog; then it sleeps by the river. " * 40
        + "What did the fox do?")


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    threads = torch.get_num_threads()
    model = LLM(gguf_path, device="cpu", dtype="float32", kv_dtype="float32", max_num_seqs=2,
                max_model_len=1024, prefill_chunk=CHUNK, num_threads=1, progress=False)
    yield model
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(gguf_reader):
    """ids -> transformers' final hidden states [len(ids), hidden] float64."""
    model = hf_model(gguf_reader)

    @functools.cache
    def states(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()

    return lambda ids: states(tuple(ids))


def row_bound(rows: torch.Tensor, llm: LLM) -> torch.Tensor:
    """Twice one side's bound on |muser - transformers| for the exact rows [T, hidden]."""
    cfg = llm.model_config
    ops = OPS_PER_LAYER * cfg.num_layers + 2
    atol, rtol = 2 * ops * (8 * U + gamma(cfg.intermediate_size)), 2 * ops * 8 * U
    rms = rows.pow(2).mean(-1, keepdim=True).sqrt()
    return atol * rms + rtol * rows.abs()


def pooled_reference(rows: torch.Tensor, bound: torch.Tensor, pooling: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rows pooled, and the bound pooled with them."""
    if pooling == "mean":
        mean = rows.mean(0, keepdim=True)
        return mean, bound.mean(0, keepdim=True) + 2 * U * mean.abs()
    if pooling == "none":
        return rows, bound
    at = 0 if pooling == "cls" else -1
    return rows[at:at + 1] if at == 0 else rows[at:], bound[at:at + 1] if at == 0 else bound[at:]


@pytest.mark.parametrize("pooling", ["mean", "last", "cls", "none"])
def test_pooled_states_within_the_bound_of_transformers(llm: LLM, reference,
                                                        pooling: str) -> None:
    for text in (SHORT, LONG):
        ids = llm.encode(text)
        rows = reference(ids)
        want, bound = pooled_reference(rows, row_bound(rows, llm), pooling)
        got = torch.tensor(llm.embed(ids, pooling), dtype=torch.float64)
        assert got.shape == want.shape == (len(ids) if pooling == "none" else 1, 640)
        assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    assert len(llm.encode(LONG)) > llm.model_config.sliding_window + 2 * CHUNK


def test_rows_equal_a_one_chunk_prefill_bitwise(llm: LLM) -> None:
    ids = llm.encode(LONG)
    chunked = torch.tensor(llm.embed(ids, "none"))
    seq = llm.runner.allocate()
    try:
        _, whole = llm.runner.forward_hidden([seq], [ids], hidden_rows=list(range(len(ids))))
    finally:
        llm.runner.free(seq)
    assert torch.equal(chunked, whole)


@pytest.fixture(scope="module")
def embedder(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = start_server(gguf_path, tmp_path_factory.mktemp("embed"),
                     ["--embedding", "--max-num-seqs", "2", "--max-model-len", "1024"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def test_openai_client(embedder: Server, llm: LLM, reference) -> None:
    client = openai.OpenAI(api_key="any", base_url=embedder.url + "/v1", max_retries=0)
    short, long = llm.encode(SHORT), llm.encode(LONG)
    before = embedder.metric("muser_prompt_tokens_total")
    ttft = embedder.metric("muser_ttft_seconds_count")
    res = client.embeddings.create(model="any", input=[SHORT, LONG, short])  # base64 on the wire
    assert [d.index for d in res.data] == [0, 1, 2]
    assert res.usage.prompt_tokens == res.usage.total_tokens == 2 * len(short) + len(long)
    assert embedder.metric("muser_prompt_tokens_total") - before == res.usage.prompt_tokens
    assert embedder.metric("muser_ttft_seconds_count") == ttft  # no token came
    for d, ids in zip(res.data, (short, long, short)):
        rows = reference(ids)
        mean, bound = pooled_reference(rows, row_bound(rows, llm), "mean")
        got = torch.tensor(d.embedding, dtype=torch.float64)
        assert abs(float(got.norm()) - 1) < 1e-6
        assert float((got - _unit(mean[0])).norm()) <= 2 * float(bound.norm() / mean.norm())
    assert res.data[0].embedding == res.data[2].embedding  # the text and its ids
    floats = client.embeddings.create(model="any", input=SHORT, encoding_format="float")
    assert floats.data[0].embedding == res.data[0].embedding  # the same float32 values
    assert client.embeddings.create(model="any", input=SHORT,
                                    dimensions=640).data[0].embedding == res.data[0].embedding
    with pytest.raises(openai.BadRequestError, match="640 dimensions"):
        client.embeddings.create(model="any", input=SHORT, dimensions=256)


def test_base64_is_the_float32_bytes(embedder: Server) -> None:
    c = embedder.client(None)
    vec = c.post("/v1/embeddings", json={"input": SHORT}).json()["data"][0]["embedding"]
    raw = c.post("/v1/embeddings", json={"input": SHORT, "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == vec


def test_llama_shape_and_normalizations(embedder: Server) -> None:
    c = embedder.client(None)

    def vector(norm: int | None, route: str = "/embedding") -> list[float]:
        body = {"content": SHORT} | ({} if norm is None else {"embd_normalize": norm})
        res = c.post(route, json=body).json()
        assert [r["index"] for r in res] == [0] and len(res[0]["embedding"]) == 1
        return res[0]["embedding"][0]

    raw = torch.tensor(vector(-1), dtype=torch.float64)
    assert raw.norm() > 10  # not normalized
    for norm, size in ((1, raw.abs().sum()), (2, raw.norm()), (3, raw.abs().pow(3).sum() ** (1 / 3)),
                       (0, raw.abs().max() / 32760)):
        got = torch.tensor(vector(norm), dtype=torch.float64)
        assert torch.allclose(got, raw / size, rtol=2 * U, atol=0), norm
    assert vector(None) == vector(2) == vector(None, "/embeddings")
    both = c.post("/embeddings", json={"input": [SHORT, "This is a test"]}).json()
    assert [r["index"] for r in both] == [0, 1] and both[0]["embedding"][0] == vector(2)


def test_prompt_objects(embedder: Server) -> None:
    """llama-server's prompt objects: {"prompt_string"} and {"content": [text parts]}, whose
    texts join as they are."""
    c = embedder.client(None)
    parts = {"content": [{"type": "text", "text": "This is "}, {"type": "text", "text": "a test"}]}
    res = c.post("/v1/embeddings", json={"input": [
        "This is a test", {"prompt_string": "This is a test"}, parts]}).json()
    assert res["data"][0]["embedding"] == res["data"][1]["embedding"] == res["data"][2][
        "embedding"]
    ids = c.post("/tokenize", json={"content": "This is a test", "add_special": True}).json()[
        "tokens"]
    mixed = c.post("/v1/embeddings", json={"input": [ids, [ids[0], "This is a test"]]}).json()
    assert mixed["data"][0]["embedding"] == mixed["data"][1]["embedding"] == res["data"][0][
        "embedding"]
    for bad in ({"content": "text"}, {"content": [{"type": "image_url", "image_url": {}}]}, {}):
        assert c.post("/v1/embeddings", json={"input": bad}).status_code == 400, bad


def test_errors(embedder: Server, server: Server) -> None:
    off = server.client().post("/v1/embeddings", json={"input": SHORT})
    assert off.status_code == 501 and "`--embedding`" in off.json()["error"]["message"]
    assert server.client().post("/embedding", json={"content": SHORT}).status_code == 501
    c = embedder.client(None)
    cases = [({"input": []}, "input"), ({}, "input"), ({"input": SHORT, "content": SHORT}, "input"),
             ({"input": SHORT, "encoding_format": "hex"}, "encoding_format"),
             ({"input": SHORT, "dimensions": 0}, "dimensions"),
             ({"input": SHORT, "embd_normalize": -2}, "embd_normalize"),
             ({"input": "This is a test " * 512}, "prompt")]
    for body, param in cases:
        res = c.post("/v1/embeddings", json=body)
        assert res.status_code == 400, (body, res.text)
        assert res.json()["error"]["param"].startswith(param), (body, res.text)
    res = c.post("/embedding", json={"content": SHORT, "encoding_format": "base64"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "encoding_format"
    # completions run beside embeddings on the same engine
    res = c.post("/completion", json={"prompt": SHORT, "n_predict": 2, "temperature": 0})
    assert res.status_code == 200 and res.json()["tokens_predicted"] == 2


def test_pooling_none(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory, llm: LLM,
                      reference) -> None:
    s = start_server(gguf_path, tmp_path_factory.mktemp("embed-none"),
                     ["--embedding", "--pooling", "none", "--max-num-seqs", "1",
                      "--max-model-len", "256"])
    try:
        c = s.client(None)
        ids = llm.encode(SHORT)
        res = c.post("/embedding", json={"content": SHORT, "embd_normalize": 2})
        rows = torch.tensor(res.json()[0]["embedding"], dtype=torch.float64)
        want = reference(ids)
        assert rows.shape == (len(ids), 640)
        assert ((rows - want).abs() <= row_bound(want, llm)).all()  # per token, not normalized
        refused = c.post("/v1/embeddings", json={"input": SHORT})
        assert refused.status_code == 400 and "'none'" in refused.json()["error"]["message"]
    finally:
        stop_server(s.proc)


def test_pooling_needs_embedding() -> None:
    parse = build_parser().parse_args
    assert server_options(parse(["serve", "--embeddings"])).pooling == "mean"  # llama-server's
    assert server_options(parse(["serve", "--embedding", "--pooling", "cls"])).pooling == "cls"
    assert server_options(parse(["serve"])).pooling is None
    with pytest.raises(MuserError, match="--pooling is how --embedding pools"):
        server_options(parse(["serve", "--pooling", "cls"]))
