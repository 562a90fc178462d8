"""Transformer shapes and exact parameter counts."""

from __future__ import annotations

import pytest

from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_planner import Transformer


@pytest.mark.parametrize("ref", sorted(MODEL_CATALOG))
def test_catalog_models_count_exactly_like_the_catalog(ref: str) -> None:
    config = MODEL_CATALOG[ref]
    model = Transformer.from_model_config(config)
    assert model.exact_parameters == config.num_parameters
    assert model.parameters == config.num_parameters
    assert model.seq_len == config.max_seq_len


def test_sequence_length_can_be_shorter_than_the_maximum() -> None:
    config = MODEL_CATALOG["gpt-tiny@v1"]
    assert Transformer.from_model_config(config, seq_len=64).seq_len == 64


PUBLISHED = [
    # (name, shape, published parameter count, relative tolerance).
    # Brown et al. 2020 Table 2.1: GPT-3 with learned positions, tied embeddings, vocabulary 50257
    # (13B has 40 heads of 128 in a 5140-wide model). Touvron et al. 2023, Llama 2 7B: SwiGLU 11008,
    # no biases, RoPE, untied head, vocabulary 32000; its released checkpoint holds 6,738,415,616.
    ("GPT-3 175B", Transformer(n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048),
     175e9, 0.01),
    ("GPT-3 13B", Transformer(n_layers=40, d_model=5140, n_heads=40, d_head=128, vocab_size=50257,
                              seq_len=2048),
     13e9, 0.01),
    ("Llama 2 7B", Transformer(n_layers=32, d_model=4096, n_heads=32, d_ff=11008, vocab_size=32000,
                               seq_len=4096, gated_mlp=True, biases=False, learned_positions=False,
                               tied_embeddings=False),
     6_738_415_616, 0),
    # Llama 2 70B: grouped-query attention with 8 kv heads of 64 heads, SwiGLU 28672; its released
    # checkpoint holds 68,976,648,192.
    ("Llama 2 70B", Transformer(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                                vocab_size=32000, seq_len=4096, gated_mlp=True, biases=False,
                                learned_positions=False, tied_embeddings=False),
     68_976_648_192, 0),
]


@pytest.mark.parametrize(("name", "model", "published", "tolerance"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_models(name: str, model: Transformer, published: float, tolerance: float) -> None:
    assert model.exact_parameters == pytest.approx(published, rel=tolerance)


@pytest.mark.parametrize("n", [125e6, 1.3e9, 7e9, 13e9, 70e9, 175e9, 1e12])
def test_from_parameters_keeps_the_declared_count_and_a_close_shape(n: float) -> None:
    model = Transformer.from_parameters(n)
    assert model.parameters == int(n)
    assert model.exact_parameters == pytest.approx(n, rel=0.25)
    assert model.d_model % model.n_heads == 0


def test_pipeline_stage_holds_its_layers_and_the_embedding() -> None:
    model = Transformer(n_layers=8, d_model=64, n_heads=4, vocab_size=100, seq_len=16)
    first = 2 * model.parameters_per_layer + model.input_embedding_parameters
    last = 2 * model.parameters_per_layer + model.output_parameters + 100 * 64  # its own head copy
    assert model.stage_parameters(4) == max(first, last)
    assert model.stage_parameters(1) == model.parameters


def test_width_must_split_into_heads() -> None:
    with pytest.raises(ValueError, match="divisible by nHeads"):
        Transformer(n_layers=2, d_model=100, n_heads=3, vocab_size=10, seq_len=8)


def test_llama_catalog_models_take_the_llama_shape() -> None:
    config = MODEL_CATALOG["llama-1b@v1"]
    model = Transformer.from_model_config(config)
    shape = (model.tied_embeddings, model.learned_positions, model.biases, model.gated_mlp)
    assert shape == (False, False, False, True)
    assert model.n_kv_heads == 4 and model.kv_width == 4 * 64
    assert model.exact_parameters == 1_100_048_384  # TinyLlama-1.1B's released checkpoint
    gpt = Transformer.from_model_config(MODEL_CATALOG["gpt-tiny@v1"])
    assert (gpt.tied_embeddings, gpt.learned_positions, gpt.biases, gpt.gated_mlp, gpt.n_kv_heads) == (
        True, True, True, False, None)


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="nKvHeads"):
        Transformer(n_layers=1, d_model=64, n_heads=4, n_kv_heads=3, vocab_size=10, seq_len=8)


@pytest.mark.parametrize("ref", sorted(MODEL_CATALOG))
def test_transformer_for_keeps_the_catalogs_exact_count_at_any_sequence_length(ref: str) -> None:
    """Learned positions count maxSeqLen rows even when a job trains on shorter sequences."""
    from trainyard_planner import transformer_for

    config = MODEL_CATALOG[ref]
    short = transformer_for(config, 16)
    assert short.seq_len == 16 and short.parameters == config.num_parameters
    assert transformer_for(config).seq_len == config.max_seq_len
