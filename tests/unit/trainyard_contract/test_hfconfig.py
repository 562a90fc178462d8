"""config.json of each architecture: transformers reads it as the right class, and it reads back."""

import pytest
import transformers

from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.errors import ConfigError
from trainyard_contract.hfconfig import hf_config, model_config_from_hf


@pytest.mark.parametrize("ref", sorted(MODEL_CATALOG))
def test_the_catalog_round_trips_through_transformers_config(ref: str) -> None:
    config = MODEL_CATALOG[ref]
    data = hf_config(config, bos_token_id=0, eos_token_id=0)
    hf = transformers.AutoConfig.for_model(**data)
    assert type(hf).__name__ == {"gpt2": "GPT2Config", "llama": "LlamaConfig"}[config.architecture]
    assert model_config_from_hf(hf.to_dict()) == config
    assert model_config_from_hf(data) == config


@pytest.mark.parametrize(("change", "named"), [
    ({"model_type": "mistral"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_theta": 500000.0}, "rope_theta"),
    ({"num_key_value_heads": 3}, "nKvHeads"),
])
def test_what_trainyard_cannot_reproduce_is_refused_by_name(change: dict, named: str) -> None:
    data = hf_config(MODEL_CATALOG["llama-tiny@v1"]) | change
    with pytest.raises(ConfigError, match=named):
        model_config_from_hf(data)


def test_a_missing_key_is_named() -> None:
    data = hf_config(MODEL_CATALOG["gpt-tiny@v1"])
    del data["n_embd"]
    with pytest.raises(ConfigError, match="n_embd"):
        model_config_from_hf(data)
