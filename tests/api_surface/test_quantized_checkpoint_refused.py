"""A checkpoint stored quantized (config.json ``quantization_config``) is refused at load with a message
naming its method: pdserve would otherwise run the packed weights unscaled and answer garbage."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.model_executor.model_loader import load_arch, load_model

CONFIG = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}
METHODS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path, method):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": METHODS[method]}))
    for load in (load_arch, load_model):  # the server's early check, then each rank's load
        with pytest.raises(ValueError, match=f"quantized with '{method}'"):
            load(str(tmp_path))


def test_the_same_config_without_quantization_config_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert load_arch(str(tmp_path)).num_layers == 1


def test_a_server_on_a_quantized_checkpoint_exits_at_start_naming_the_method(tmp_path):
    """Before any rank loads weights, and before the tokenizer (this directory has none)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": METHODS["gptq"]}))
    r = subprocess.run([sys.executable, "-m", "pdserve.engine", "--model-path", str(tmp_path), "--port", "0",
                        "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "quantized with 'gptq'" in r.stderr + r.stdout
