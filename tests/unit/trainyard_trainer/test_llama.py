"""The llama architecture: shapes, a training step, and parity with transformers' LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch

from trainyard_contract.catalog import LLAMA_RMS_NORM_EPS, LLAMA_ROPE_THETA, MODEL_CATALOG, ModelConfig
from trainyard_trainer.model import GPT, Llama, build_model, hf_llama_name

TINY = MODEL_CATALOG["llama-tiny@v1"]


def llama(**changes: object) -> ModelConfig:
    base = {"architecture": "llama", "vocab_size": 97, "n_layers": 2, "n_heads": 4, "d_model": 32,
            "d_ff": 48, "max_seq_len": 16}
    return ModelConfig(**{**base, **changes})


def test_build_model_builds_the_architecture_of_the_config() -> None:
    assert isinstance(build_model(TINY, seed=0, device=torch.device("cpu")), Llama)
    assert isinstance(build_model(MODEL_CATALOG["gpt-tiny@v1"], seed=0, device=torch.device("cpu")), GPT)
    with pytest.raises(ValueError, match="architecture"):
        GPT(TINY)
    with pytest.raises(ValueError, match="architecture"):
        Llama(MODEL_CATALOG["gpt-tiny@v1"])


def test_llama_tiny_shapes_and_untied_bias_free_head() -> None:
    model = build_model(TINY, seed=0, device=torch.device("cpu"))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["blocks.0.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["blocks.0.self_attn.k_proj.weight"] == (32, 64)  # 2 kv heads of 16
    assert shapes["blocks.0.self_attn.v_proj.weight"] == (32, 64)
    assert shapes["blocks.0.mlp.gate_proj.weight"] == (176, 64)
    assert shapes["lm_head.weight"] == (1024, 64)
    assert not any(name.endswith(".bias") for name in shapes)
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    idx = torch.randint(0, TINY.vocab_size, (3, 20))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 20, TINY.vocab_size) and loss is not None and torch.isfinite(loss)


def test_forward_backward_reaches_every_parameter_and_a_step_lowers_the_loss() -> None:
    model = build_model(TINY, seed=1, device=torch.device("cpu"))
    idx = torch.randint(0, TINY.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, first = model(x, y)
    first.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    optimizer.step()
    optimizer.zero_grad()
    _, second = model(x, y)
    assert second < first


def test_same_seed_same_weights() -> None:
    a = build_model(TINY, seed=3, device=torch.device("cpu")).state_dict()
    b = build_model(TINY, seed=3, device=torch.device("cpu")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_attention_is_causal() -> None:
    model = build_model(TINY, seed=0, device=torch.device("cpu")).eval()
    idx = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_sequence_longer_than_max_is_refused() -> None:
    model = Llama(llama())
    with pytest.raises(ValueError, match="maxSeqLen"):
        model(torch.zeros(1, 17, dtype=torch.long))


def hf_twin(config: ModelConfig, model: Llama) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of the same shape (built offline), with ``model``'s weights
    copied across by name."""
    import transformers
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_width,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=LLAMA_RMS_NORM_EPS, rope_parameters={"rope_type": "default", "rope_theta": LLAMA_ROPE_THETA},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
    )
    hf_config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    ours = {hf_llama_name(name): p for name, p in model.state_dict().items()}
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs)  # names map 1:1, nothing left over on either side
    hf.load_state_dict(ours, strict=True)
    return hf


@pytest.mark.parametrize("config", [
    TINY,  # grouped-query attention: 4 query heads over 2 kv heads
    llama(n_kv_heads=None),  # multi-head (kv heads = heads)
    llama(n_kv_heads=1),  # multi-query
], ids=["llama-tiny-gqa", "mha", "mqa"])
def test_logits_equal_transformers_llama_with_the_same_weights(config: ModelConfig) -> None:
    model = build_model(config, seed=5, device=torch.device("cpu")).eval()
    # Norm weights away from one so a wrong norm placement cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.uniform_(0.5, 1.5)
    hf = hf_twin(config, model)
    idx = torch.randint(0, config.vocab_size, (2, config.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(input_ids=idx).logits
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_hf_names() -> None:
    assert hf_llama_name("blocks.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_llama_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert hf_llama_name("norm.weight") == "model.norm.weight"
    assert hf_llama_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize(("sharding", "checkpointing"),
                         [("ddp", False), ("ddp", True), ("zero1", True), ("zero2", False), ("fsdp", True)])
def test_data_parallel_wrappers_and_activation_checkpointing_keep_the_gradients(
        world_of_one: None, sharding: str, checkpointing: bool) -> None:
    """The parallel modes that need nothing architecture-specific wrap the llama as they wrap the GPT
    (a one-rank world here; the 2-rank comparisons come with the tensor/pipeline slice)."""
    from trainyard_trainer.parallel import build_mesh, parallelize, resolve_plan

    cpu = torch.device("cpu")
    plan = resolve_plan(world_size=1, local_world_size=1, tensor=1, pipeline=1, sharding=sharding,
                        activation_checkpointing=checkpointing, config=TINY)
    pm = parallelize(build_model(TINY, seed=2, device=cpu), plan, rank=0, device=cpu, mesh=build_mesh(plan, "cpu"))
    reference = build_model(TINY, seed=2, device=cpu)
    idx = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    loss = pm.module(idx[:, :-1], idx[:, 1:])[1]
    expected = reference(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    grads = {n.removeprefix("module.").replace("_checkpoint_wrapped_module.", ""): p.grad
             for n, p in pm.module.named_parameters()}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}  # FSDP2
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
