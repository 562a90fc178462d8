import pytest
import torch

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_trainer.model import GPT, build_model, model_class


@pytest.mark.parametrize("ref", sorted(MODEL_CATALOG))
def test_parameter_count_matches_the_catalog_formula(ref: str) -> None:
    config = MODEL_CATALOG[ref]
    with torch.device("meta"):  # gpt-1b would need 5 GB of real memory
        model = model_class(config)(config)
    assert model.num_parameters() == config.num_parameters


def test_parameter_count_with_explicit_ffn_width() -> None:
    config = ModelConfig(vocab_size=97, n_layers=3, n_heads=2, d_model=8, d_ff=20, max_seq_len=11)
    assert GPT(config).num_parameters() == config.num_parameters


def tiny() -> ModelConfig:
    return ModelConfig(vocab_size=50, n_layers=2, n_heads=2, d_model=16, max_seq_len=12)


def test_embeddings_are_tied() -> None:
    model = GPT(tiny())
    x = torch.randint(0, 50, (2, 5))
    logits, _ = model(x)
    assert logits.shape == (2, 5, 50)
    hidden = model.blocks[1](model.blocks[0](model.wte(x) + model.wpe(torch.arange(5))))
    expected = model.ln_f(hidden) @ model.wte.weight.T
    torch.testing.assert_close(logits, expected)


def test_attention_is_causal() -> None:
    model = GPT(tiny()).eval()
    x = torch.randint(0, 50, (1, 10))
    y = x.clone()
    y[0, 7:] = (y[0, 7:] + 1) % 50
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(y)
    torch.testing.assert_close(a[0, :7], b[0, :7])
    assert not torch.allclose(a[0, 7:], b[0, 7:])


def test_loss_starts_near_uniform_and_backpropagates() -> None:
    model = build_model(tiny(), seed=0, device=torch.device("cpu"))
    x = torch.randint(0, 50, (4, 12))
    _, loss = model(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.3
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_build_model_is_seeded_and_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model(tiny(), seed=5, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model(tiny(), seed=5, device=torch.device("cpu"))
    c = build_model(tiny(), seed=6, device=torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_sequence_longer_than_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="maxSeqLen"):
        GPT(tiny())(torch.zeros(1, 13, dtype=torch.long))


@pytest.mark.parametrize("config", [
    *(MODEL_CATALOG[ref] for ref in sorted(MODEL_CATALOG)),
    ModelConfig(vocab_size=97, n_layers=3, n_heads=2, d_model=8, d_ff=20, max_seq_len=11),
    ModelConfig(architecture="llama", vocab_size=97, n_layers=3, n_heads=4, d_model=32, d_ff=40, max_seq_len=11),
    ModelConfig(architecture="llama", vocab_size=97, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32, d_ff=40,
                max_seq_len=11),
    ModelConfig(architecture="llama", vocab_size=97, n_layers=1, n_heads=4, n_kv_heads=1, d_model=32, max_seq_len=5),
], ids=lambda c: f"{c.architecture}-L{c.n_layers}-d{c.d_model}-h{c.n_heads}-kv{c.kv_heads}-v{c.vocab_size}")
def test_planner_counts_exactly_the_parameters_of_the_built_model(config: ModelConfig) -> None:
    from trainyard_planner import Transformer

    with torch.device("meta"):
        model = model_class(config)(config)
    built = sum(p.numel() for p in model.parameters())
    assert Transformer.from_model_config(config).exact_parameters == built == config.num_parameters
