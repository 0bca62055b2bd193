"""Gemma 4 checkpoints: the text model inside Gemma4ForConditionalGeneration loads (its vision
and audio towers skipped, one log line) and matches transformers' logits; both config.json
forms of the full layers' geometry map onto one ModelConfig; incomplete expert settings and
geometries muser does not carry end in one clear error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from muser.errors import ModelLoadError
from muser.loading import load_model
from muser.loading.hf import config_from_hf
from tests.gemma4.checkpoints import write_checkpoint, write_multimodal
from tests.gemma4.test_parity import ATOL, RTOL, prompt, runner_of


def test_multimodal_checkpoint_runs_its_text_model(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    reference = write_multimodal(tmp_path)
    with caplog.at_level(logging.INFO, logger="muser.loading"):
        model = load_model(tmp_path, torch.float32, "cpu", progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "muser.loading"]
    assert lines == [("Gemma4ForConditionalGeneration: loading the text model; its vision and "
                      "audio towers are skipped")]
    ids = prompt(30, 0)
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([ids])).logits[0].double()
    runner = runner_of(model)
    got = runner.forward([runner.allocate()], [ids], logit_rows=list(range(30))).double()
    assert ((got - want).abs() - (ATOL + RTOL * want.abs())).max() <= 0


def _saved_config(tmp_path: Path, variant: str) -> dict:
    return json.loads((write_checkpoint(variant, tmp_path) / "config.json").read_text())


def test_published_geometry_keys_map_as_transformers_saves(tmp_path: Path) -> None:
    """The published configs name the full layers' geometry global_head_dim and
    num_global_key_value_heads; transformers' saves write per_layer_config."""
    saved = _saved_config(tmp_path, "k_eq_v")
    assert saved["per_layer_config"]["2"] == {"head_dim": 32, "num_key_value_heads": 1}
    published = {k: v for k, v in saved.items() if k != "per_layer_config"}
    published |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    assert config_from_hf(published) == config_from_hf(saved)
    # as transformers reads them: the KV heads of the full layers only with K=V
    plain = dict(published, attention_k_eq_v=False)
    assert config_from_hf(plain).kv_row("global") == (2, 32)


@pytest.mark.parametrize(("change", "message"), [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2},
     "enable_moe_block without moe_intermediate_size"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5,
      "moe_intermediate_size": 32}, r"top_k_experts must be in 1 \.\. num_experts \(4\)"),
    ({"per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 64}, "7": {"head_dim": 32}}},
     "per_layer_config gives layers of one kind different geometries"),
    ({"per_layer_config": {"2": {"sliding_window": 4}}},
     r"per_layer_config of layer 2 sets \['sliding_window'\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
     "rope type 'yarn' on full layers is not supported"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention = 'all'"),
    ({"num_kv_shared_layers": 6}, "KV-sharing layer 2 has no earlier global layer"),
])
def test_unsupported_configs_fail_with_one_line(tmp_path: Path, change: dict,
                                                message: str) -> None:
    config = _saved_config(tmp_path, "dense") | change
    with pytest.raises(ModelLoadError, match=message) as info:
        config_from_hf(config)
    assert "\n" not in str(info.value)
