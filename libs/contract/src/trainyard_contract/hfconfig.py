"""A model's shape as a Hugging Face ``config.json``, and back (pure: no torch, no transformers).

trainyard's ``gpt2`` architecture is ``GPT2LMHeadModel`` (exact GELU, LayerNorm eps 1e-5, tied
head); ``llama`` is ``LlamaForCausalLM`` (SiLU-gated MLP, RMSNorm, rotary positions with the
transformers convention, grouped-query attention, untied head, no biases). :func:`hf_config` writes
the ``config.json`` of an export; :func:`model_config_from_hf` reads one back (``initFrom.huggingFace``
and the API's check of it) and refuses, naming the key, whatever trainyard's networks cannot
reproduce exactly — so a directory that loads is a directory whose logits match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from trainyard_contract.catalog import LLAMA_RMS_NORM_EPS, LLAMA_ROPE_THETA, ModelConfig
from trainyard_contract.errors import ConfigError

#: The ``architectures`` entry of each trainyard architecture.
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
GPT2_LAYER_NORM_EPS = 1e-5


def hf_config(config: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
              torch_dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for ``config`` (keys sorted when written; values transformers reads)."""
    common: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[config.architecture]],
        "vocab_size": config.vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,
    }
    if config.architecture == "llama":
        return common | {
            "model_type": "llama",
            "hidden_size": config.d_model,
            "intermediate_size": config.ffn_width,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "max_position_embeddings": config.max_seq_len,
            "hidden_act": "silu",
            "rms_norm_eps": LLAMA_RMS_NORM_EPS,
            "rope_theta": LLAMA_ROPE_THETA,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": config.dropout,
            "tie_word_embeddings": False,
        }
    return common | {
        "model_type": "gpt2",
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.ffn_width,
        "n_positions": config.max_seq_len,
        "n_ctx": config.max_seq_len,
        "activation_function": "gelu",
        "layer_norm_epsilon": GPT2_LAYER_NORM_EPS,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
    }


def _require(data: Mapping[str, Any], key: str, expected: Any, why: str) -> None:
    value = data.get(key, expected)
    if value != expected and not (isinstance(expected, float) and isinstance(value, int | float)
                                  and abs(value - expected) <= 1e-12 * max(1.0, abs(expected))):
        raise ConfigError(f"config.json {key} = {value!r}: trainyard's {why} needs {expected!r}")


def model_config_from_hf(data: Mapping[str, Any]) -> ModelConfig:
    """The inline ``ModelConfig`` of a ``config.json``; ConfigError naming the key when trainyard's
    networks cannot reproduce the model exactly (another activation, biases on a llama, rope scaling…)."""
    model_type = data.get("model_type")
    try:
        if model_type == "llama":
            _require(data, "hidden_act", "silu", "llama MLP (SwiGLU)")
            _require(data, "attention_bias", False, "llama (no biases)")
            _require(data, "mlp_bias", False, "llama (no biases)")
            _require(data, "tie_word_embeddings", False, "llama (an untied output head)")
            _require(data, "rope_scaling", None, "llama (plain rotary positions)")
            _require(data, "rms_norm_eps", LLAMA_RMS_NORM_EPS, "llama RMSNorm")
            _require(data, "rope_theta", LLAMA_ROPE_THETA, "llama rotary positions")
            d, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
            if "head_dim" in data and data["head_dim"] is not None and int(data["head_dim"]) != d // heads:
                raise ConfigError(f"config.json head_dim = {data['head_dim']}: trainyard's llama needs "
                                  f"hidden_size / num_attention_heads = {d // heads}")
            kv = data.get("num_key_value_heads")
            return ModelConfig(
                architecture="llama", vocab_size=int(data["vocab_size"]), n_layers=int(data["num_hidden_layers"]),
                n_heads=heads, d_model=d, d_ff=int(data["intermediate_size"]),
                max_seq_len=int(data["max_position_embeddings"]),
                n_kv_heads=None if kv is None or int(kv) == heads else int(kv),
                dropout=float(data.get("attention_dropout") or 0.0),
            )
        if model_type == "gpt2":
            _require(data, "activation_function", "gelu", "gpt2 MLP (exact GELU)")
            _require(data, "layer_norm_epsilon", GPT2_LAYER_NORM_EPS, "gpt2 LayerNorm")
            _require(data, "tie_word_embeddings", True, "gpt2 (the output head tied to the embedding)")
            _require(data, "scale_attn_weights", True, "gpt2 attention")
            _require(data, "scale_attn_by_inverse_layer_idx", False, "gpt2 attention")
            d = int(data["n_embd"])
            inner = data.get("n_inner")
            return ModelConfig(
                vocab_size=int(data["vocab_size"]), n_layers=int(data["n_layer"]), n_heads=int(data["n_head"]),
                d_model=d, d_ff=None if inner is None or int(inner) == 4 * d else int(inner),
                max_seq_len=int(data["n_positions"]), dropout=float(data.get("resid_pdrop") or 0.0),
            )
    except KeyError as missing:
        raise ConfigError(f"config.json has no {missing.args[0]!r}, which a {model_type} config needs") from None
    except (TypeError, ValueError) as bad:
        if isinstance(bad, ValidationError):
            first = bad.errors()[0]
            raise ConfigError(f"config.json describes no model trainyard can build: {first['msg']}") from None
        raise ConfigError(f"config.json: {bad}") from None
    raise ConfigError(f"config.json model_type = {model_type!r}: trainyard builds 'gpt2' and 'llama' models")
