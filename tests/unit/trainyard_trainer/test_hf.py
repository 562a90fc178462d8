"""trainyard_trainer.hf against the real client: every export loads with transformers'
AutoModelForCausalLM / AutoTokenizer (offline, from the directory) and gives our model's logits
within 1e-5 (fp32, CPU); directories saved by transformers itself read back into our model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainyard.checkpoint import save_checkpoint
from trainyard.data import END_OF_TEXT, train_tokenizer
from trainyard.state import ModelState
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import CheckpointCorruptError, CheckpointError, ConfigError
from trainyard_contract.exitcodes import CHECKPOINT, CONFIG
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.storage import path_to_uri, sha256_file
from trainyard_trainer import hf
from trainyard_trainer.export_cli import parse_size
from trainyard_trainer.model import GPT, Llama, build_model

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing leaves this machine
os.environ["TRANSFORMERS_OFFLINE"] = "1"
import transformers  # noqa: E402 - after the offline switches above

GPT_SMALL = ModelConfig(vocab_size=300, n_layers=2, n_heads=4, d_model=32, d_ff=48, max_seq_len=24)
LLAMA_GQA = ModelConfig(architecture="llama", vocab_size=300, n_layers=2, n_heads=6, n_kv_heads=2, d_model=48,
                        d_ff=80, max_seq_len=24)
LLAMA_MHA = ModelConfig(architecture="llama", vocab_size=300, n_layers=1, n_heads=4, d_model=32, d_ff=40,
                        max_seq_len=24)
CONFIGS = [
    pytest.param(MODEL_CATALOG["gpt-tiny@v1"], id="gpt-tiny"),
    pytest.param(GPT_SMALL, id="gpt2-inline"),
    pytest.param(MODEL_CATALOG["llama-tiny@v1"], id="llama-tiny"),
    pytest.param(LLAMA_GQA, id="llama-gqa-inline"),
    pytest.param(LLAMA_MHA, id="llama-mha-inline"),
]
TEXT = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine."


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [TEXT, "Pack my box with five dozen liquor jugs.", "How vexingly quick daft zebras jump!"] * 20
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_tokenizer(texts, 290))
    return path


def random_model(config: ModelConfig, seed: int = 0) -> GPT | Llama:
    model = build_model(config, seed=seed, device=torch.device("cpu")).eval()
    with torch.no_grad():  # norms and biases away from their initial ones/zeros, so a mix-up would show
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def inputs(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, config.max_seq_len - 6),
                         generator=torch.Generator().manual_seed(42))


def our_logits(model: GPT | Llama, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)[0]


def hf_logits(directory: Path, idx: torch.Tensor) -> torch.Tensor:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return theirs(idx).logits


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), name


# ----------------------------------------------------------------------------- pure mapping


def test_gpt2_qkv_goes_from_head_major_rows_to_conv1d_q_k_v_columns() -> None:
    heads, d = 2, 4  # head width 2
    config = ModelConfig(vocab_size=8, n_layers=1, n_heads=heads, d_model=d, max_seq_len=4)
    state = {n: torch.zeros(s) for n, s in hf.expected_shapes(config).items()}
    # row r of our fused weight: head r // 6, part (r % 6) // 2 (q, k, v), element r % 2
    state["blocks.0.attn.qkv.weight"] = torch.arange(3 * d, dtype=torch.float32)[:, None].repeat(1, d)
    state["blocks.0.attn.qkv.bias"] = torch.arange(3 * d, dtype=torch.float32)
    out = hf.to_hf_state_dict(config, state)
    c_attn = out["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.shape == (d, 3 * d)  # Conv1D: [in, out]
    # HF columns: q of head 0, q of head 1, k of head 0, k of head 1, v of head 0, v of head 1
    expected_rows = [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    assert c_attn[0].tolist() == [float(r) for r in expected_rows]
    assert out["transformer.h.0.attn.c_attn.bias"].tolist() == [float(r) for r in expected_rows]


def test_gpt2_names_and_transposes() -> None:
    config = GPT_SMALL
    out = hf.to_hf_state_dict(config, random_model(config).state_dict())
    assert "lm_head.weight" not in out  # tied: the embedding is written once
    assert out["transformer.h.1.mlp.c_fc.weight"].shape == (32, 48)
    assert out["transformer.h.1.mlp.c_proj.weight"].shape == (48, 32)
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.bias",
            "transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.bias",
            "transformer.h.0.attn.c_proj.weight"} <= set(out)
    assert all(t.is_contiguous() for t in out.values())


@pytest.mark.parametrize("config", CONFIGS)
def test_from_hf_inverts_to_hf_exactly(config: ModelConfig) -> None:
    state = random_model(config).state_dict()
    assert_same_state(hf.from_hf_state_dict(config, hf.to_hf_state_dict(config, state)), state)


def test_a_state_of_another_shape_is_refused_naming_the_parameter() -> None:
    state = random_model(GPT_SMALL).state_dict()
    with pytest.raises(ConfigError, match=r"blocks\.0\.mlp\.fc\.weight of shape \(48, 32\).*\(128, 32\)"):
        hf.to_hf_state_dict(GPT_SMALL.model_copy(update={"d_ff": None}), state)
    with pytest.raises(ConfigError, match=r"missing \[.blocks\.2\."):
        hf.to_hf_state_dict(GPT_SMALL.model_copy(update={"n_layers": 3}), state)
    with pytest.raises(ConfigError, match="has no place for"):
        hf.from_hf_state_dict(GPT_SMALL, {**hf.to_hf_state_dict(GPT_SMALL, state), "transformer.h.9.x": torch.zeros(1)})


@pytest.mark.parametrize(("sizes", "limit", "expected"), [
    ({"a": 4, "b": 4, "c": 4}, 100, [["a", "b", "c"]]),
    ({"a": 4, "b": 4, "c": 4}, 8, [["a", "b"], ["c"]]),
    ({"a": 10, "b": 4, "c": 4}, 8, [["a"], ["b", "c"]]),  # too big for any shard: one of its own
    ({"a": 4, "b": 10, "c": 4}, 8, [["a"], ["b"], ["c"]]),
])
def test_plan_shards(sizes: dict[str, int], limit: int, expected: list[list[str]]) -> None:
    assert hf.plan_shards(sizes, limit) == expected


@pytest.mark.parametrize(("text", "size"), [("123", 123), ("2GiB", 2 * 1024**3), ("500MB", 500_000_000),
                                           ("1.5kib", 1536)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


# ----------------------------------------------------------------------------- the real client


@pytest.mark.parametrize("config", CONFIGS)
def test_export_loads_in_transformers_with_our_logits(config: ModelConfig, tokenizer_json: Path,
                                                      tmp_path: Path) -> None:
    model = random_model(config)
    out = tmp_path / "export"
    listing = hf.write_hf_model(out, config, model.state_dict(), tokenizer_json=tokenizer_json, eos_token=END_OF_TEXT)
    idx = inputs(config)
    torch.testing.assert_close(hf_logits(out, idx), our_logits(model, idx), rtol=0, atol=1e-5)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    expected_class = "LlamaForCausalLM" if config.architecture == "llama" else "GPT2LMHeadModel"
    assert type(theirs).__name__ == expected_class
    generated = theirs.generate(idx[:1, :4], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 9) and torch.equal(generated[:, :4], idx[:1, :4])
    assert {f.path for f in listing.files} == {"config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}


def test_greedy_generation_continues_as_our_model_would(tokenizer_json: Path, tmp_path: Path) -> None:
    config = MODEL_CATALOG["llama-tiny@v1"]
    model = random_model(config)
    hf.write_hf_model(tmp_path / "e", config, model.state_dict(), tokenizer_json=tokenizer_json, eos_token=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "e", local_files_only=True).eval()
    prompt = inputs(config)[:1, :4]
    ours = prompt
    for _ in range(5):
        ours = torch.cat([ours, our_logits(model, ours)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(theirs.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5), ours)


def test_the_tokenizer_loads_and_encodes_as_the_datasets(tokenizer_json: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    config = MODEL_CATALOG["gpt-tiny@v1"]
    hf.write_hf_model(tmp_path / "e", config, random_model(config).state_dict(), tokenizer_json=tokenizer_json,
                      eos_token=END_OF_TEXT)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "e", local_files_only=True)
    ours = Tokenizer.from_file(str(tokenizer_json))
    for text in (TEXT, "zebras " * 7, "unseen wörds ✓"):
        assert theirs(text)["input_ids"] == ours.encode(text).ids
        assert theirs.decode(ours.encode(text).ids) == text
    eot = ours.token_to_id(END_OF_TEXT)
    assert theirs.eos_token == END_OF_TEXT and theirs.eos_token_id == eot
    assert theirs.model_max_length == config.max_seq_len
    assert (tmp_path / "e" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    model_config = json.loads((tmp_path / "e" / "config.json").read_text())
    generation = json.loads((tmp_path / "e" / "generation_config.json").read_text())
    assert model_config["eos_token_id"] == model_config["bos_token_id"] == generation["eos_token_id"] == eot


def test_an_eos_token_the_tokenizer_lacks_is_not_declared(tokenizer_json: Path, tmp_path: Path) -> None:
    config = MODEL_CATALOG["gpt-tiny@v1"]
    hf.write_hf_model(tmp_path / "e", config, random_model(config).state_dict(), tokenizer_json=tokenizer_json,
                      eos_token="</s>")
    assert json.loads((tmp_path / "e" / "config.json").read_text())["eos_token_id"] is None
    assert "eos_token" not in json.loads((tmp_path / "e" / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("config", [MODEL_CATALOG["gpt-tiny@v1"], LLAMA_GQA], ids=["gpt2", "llama"])
def test_sharded_export_loads_the_same_and_reads_back_exactly(config: ModelConfig, tokenizer_json: Path,
                                                              tmp_path: Path) -> None:
    model = random_model(config)
    state = model.state_dict()
    out = tmp_path / "sharded"
    listing = hf.write_hf_model(out, config, state, tokenizer_json=tokenizer_json, eos_token=END_OF_TEXT,
                                max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards == [hf.shard_file_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    hf_state = hf.to_hf_state_dict(config, state)
    assert index["weight_map"].keys() == hf_state.keys() and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_state.values())
    idx = inputs(config)
    torch.testing.assert_close(hf_logits(out, idx), our_logits(model, idx), rtol=0, atol=1e-5)
    read_config, read_state = hf.read_hf_model(out)
    assert read_config == config
    assert_same_state(read_state, state)
    assert len(listing.files) == len(shards) + 5


def test_the_listing_names_every_file_and_its_hash_is_the_exports(tokenizer_json: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    config = LLAMA_MHA
    out = tmp_path / "e"
    listing = hf.write_hf_model(out, config, random_model(config).state_dict(), tokenizer_json=tokenizer_json,
                                eos_token=END_OF_TEXT)
    raw = (out / hf.LISTING_FILE).read_bytes()
    assert listing.sha256 == hashlib.sha256(raw).hexdigest()
    body = json.loads(raw)
    on_disk = {p.name for p in out.iterdir()} - {hf.LISTING_FILE}
    assert {f["path"] for f in body["files"]} == on_disk
    for entry in body["files"]:
        assert entry["sizeBytes"] == (out / entry["path"]).stat().st_size
        assert entry["sha256"] == sha256_file(out / entry["path"])
    assert listing.uri == path_to_uri(out)
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temporary sibling left behind
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # the same weights give the same export
    again = hf.write_hf_model(tmp_path / "f", config, random_model(config).state_dict(),
                              tokenizer_json=tokenizer_json, eos_token=END_OF_TEXT)
    assert again.sha256 == listing.sha256


def test_an_existing_out_dir_and_a_wrong_shape_write_nothing(tokenizer_json: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    state = random_model(GPT_SMALL).state_dict()
    with pytest.raises(ConfigError, match="already exists"):
        hf.write_hf_model(tmp_path / "taken", GPT_SMALL, state, tokenizer_json=None, eos_token=None)
    with pytest.raises(ConfigError, match="shape"):
        hf.write_hf_model(tmp_path / "new", GPT_SMALL.model_copy(update={"d_ff": 64}), state,
                          tokenizer_json=tokenizer_json, eos_token=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert list((tmp_path / "taken").iterdir()) == []


def test_bf16_state_is_written_as_bf16(tmp_path: Path) -> None:
    config = LLAMA_MHA
    state = {n: t.to(torch.bfloat16) for n, t in random_model(config).state_dict().items()}
    hf.write_hf_model(tmp_path / "e", config, state, tokenizer_json=None, eos_token=None)
    assert json.loads((tmp_path / "e" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_same_state(hf.read_hf_model(tmp_path / "e")[1], state)


# ----------------------------------------------------------------------------- directories transformers wrote


def test_a_gpt2_directory_saved_by_transformers_reads_into_our_model(tmp_path: Path) -> None:
    hf_config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=24,
                                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(hf_config).eval()
    theirs.save_pretrained(tmp_path / "gpt2")
    config, state = hf.read_hf_model(tmp_path / "gpt2")
    assert config == GPT_SMALL
    ours = GPT(config).eval()
    ours.load_state_dict(state)
    idx = inputs(config)
    with torch.no_grad():
        torch.testing.assert_close(our_logits(ours, idx), theirs(idx).logits, rtol=0, atol=1e-5)


def test_a_llama_directory_saved_by_transformers_reads_into_our_model(tmp_path: Path) -> None:
    hf_config = transformers.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=24,
                                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    theirs.save_pretrained(tmp_path / "llama", max_shard_size="50KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    config, state = hf.read_hf_model(tmp_path / "llama")
    assert config == LLAMA_GQA
    ours = Llama(config).eval()
    ours.load_state_dict(state)
    idx = inputs(config)
    with torch.no_grad():
        torch.testing.assert_close(our_logits(ours, idx), theirs(idx).logits, rtol=0, atol=1e-5)


def test_gpt2_weights_spelled_without_the_transformer_prefix_read_too(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = random_model(GPT_SMALL).state_dict()
    hf.write_hf_model(tmp_path / "e", GPT_SMALL, state, tokenizer_json=None, eos_token=None)
    hf_state = hf.to_hf_state_dict(GPT_SMALL, state)
    openai = {n.removeprefix("transformer."): t for n, t in hf_state.items()}
    openai |= {"h.0.attn.bias": torch.ones(1, 1, 24, 24), "lm_head.weight": hf_state["transformer.wte.weight"].clone()}
    save_file(openai, str(tmp_path / "e" / "model.safetensors"), metadata={"format": "pt"})
    assert_same_state(hf.read_hf_model(tmp_path / "e")[1], state)
    openai["lm_head.weight"] = openai["lm_head.weight"] + 1  # an untied head our gpt2 cannot hold
    save_file(openai, str(tmp_path / "e" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lm_head.weight differs"):
        hf.read_hf_model(tmp_path / "e")


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.pop("model_type"), "model_type"),
    (lambda d: d.update(activation_function="gelu_new"), "activation_function"),
    (lambda d: d.pop("n_embd"), "n_embd"),
])
def test_a_config_trainyard_cannot_reproduce_is_refused_naming_the_key(change, match: str, tmp_path: Path) -> None:
    hf.write_hf_model(tmp_path / "e", GPT_SMALL, random_model(GPT_SMALL).state_dict(), tokenizer_json=None,
                      eos_token=None)
    data = json.loads((tmp_path / "e" / "config.json").read_text())
    change(data)
    (tmp_path / "e" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        hf.read_hf_model(tmp_path / "e")


def test_directories_without_usable_files_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json does not exist"):
        hf.read_hf_model(tmp_path)
    hf.write_hf_model(tmp_path / "e", GPT_SMALL, random_model(GPT_SMALL).state_dict(), tokenizer_json=None,
                      eos_token=None)
    (tmp_path / "e" / "model.safetensors").rename(tmp_path / "e" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin.*safetensors"):
        hf.read_hf_model(tmp_path / "e")
    (tmp_path / "e" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        hf.read_hf_model(tmp_path / "e")


# ----------------------------------------------------------------------------- checkpoints (one process)


def write_checkpoint(model: torch.nn.Module, directory: Path) -> Path:
    """A one-rank DCP checkpoint of ``model`` and its manifest, as the coordinator writes it."""
    saved = save_checkpoint({"model": ModelState(model)}, directory, rank=0, barrier=lambda: None)
    shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256)]
    manifest = CheckpointManifest(job_id="job-1", tenant="acme", attempt=1, epoch=1, global_step=4, world_size=1,
                                  shards=shards, extra_files=saved.extra_files,
                                  content_hash=content_hash(shards, saved.extra_files))
    (directory / "manifest.json").write_bytes(manifest.to_bytes())
    return directory / "manifest.json"


def test_checkpoint_model_state_gathers_the_plain_state(tmp_path: Path) -> None:
    model = random_model(LLAMA_GQA)
    manifest_path = write_checkpoint(model, tmp_path / "step-00000004")
    for ref in (manifest_path, manifest_path.parent, path_to_uri(manifest_path)):
        manifest, state = hf.checkpoint_model_state(ref)
        assert manifest.global_step == 4
        assert_same_state(state, model.state_dict())


def test_a_checkpoint_without_manifest_or_with_a_corrupt_shard_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "step-00000004"
    manifest_path = write_checkpoint(random_model(GPT_SMALL), directory)
    shard = next(directory.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        hf.checkpoint_model_state(manifest_path)
    manifest_path.unlink()
    with pytest.raises(CheckpointCorruptError, match="not READY"):
        hf.checkpoint_model_state(directory)


def test_a_checkpoint_dcp_cannot_read_is_a_checkpoint_error_not_a_traceback(tmp_path: Path) -> None:
    directory = tmp_path / "step-00000004"
    write_checkpoint(random_model(GPT_SMALL), directory)
    (directory / ".metadata").write_bytes(b"not a pickle")  # what a foreign or truncated writer leaves
    with pytest.raises(CheckpointError, match="could not read the model"):
        hf.load_model_entries(directory)


def export_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "trainyard_trainer.export_cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def test_the_command_exports_a_checkpoint(tokenizer_json: Path, tmp_path: Path) -> None:
    model = random_model(LLAMA_MHA)
    manifest_path = write_checkpoint(model, tmp_path / "step-00000004")
    out = tmp_path / "out"
    done = export_command("--checkpoint", str(manifest_path), "--out", str(out), "--model-config",
                          LLAMA_MHA.model_dump_json(by_alias=True), "--tokenizer", str(tokenizer_json),
                          "--eos-token", END_OF_TEXT, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["uri"] == path_to_uri(out)
    assert result["sha256"] == hashlib.sha256((out / hf.LISTING_FILE).read_bytes()).hexdigest()
    assert {f["path"] for f in result["files"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert "verifying checkpoint" in done.stderr
    idx = inputs(LLAMA_MHA)
    torch.testing.assert_close(hf_logits(out, idx), our_logits(model, idx), rtol=0, atol=1e-5)


def test_the_command_refuses_a_corrupt_checkpoint_and_writes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "step-00000004"
    manifest_path = write_checkpoint(random_model(GPT_SMALL), directory)
    (directory / ".metadata").write_bytes(b"x" + (directory / ".metadata").read_bytes()[1:])
    out = tmp_path / "out"
    done = export_command("--checkpoint", str(manifest_path), "--out", str(out), "--model-config",
                          GPT_SMALL.model_dump_json(by_alias=True))
    assert done.returncode == CHECKPOINT, done.stderr
    assert "refused" in done.stderr and ".metadata" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_the_command_refuses_a_model_config_that_does_not_fit(tmp_path: Path) -> None:
    manifest_path = write_checkpoint(random_model(GPT_SMALL), tmp_path / "step-00000004")
    out = tmp_path / "out"
    done = export_command("--checkpoint", str(manifest_path), "--out", str(out), "--model-config", "gpt-tiny@v1")
    assert done.returncode == CONFIG and "shape" in done.stderr and "model config" in done.stderr
    done = export_command("--checkpoint", str(manifest_path), "--out", str(out), "--model-config", "gpt-huge@v9")
    assert done.returncode == CONFIG and "gpt-tiny@v1" in done.stderr  # names the catalog
    done = export_command("--checkpoint", str(manifest_path), "--out", str(out), "--model-config", '{"vocabSize": 3}')
    assert done.returncode == CONFIG and "--model-config" in done.stderr
    assert not out.exists()


def test_the_command_has_help() -> None:
    done = export_command("--help")
    assert done.returncode == 0 and "--checkpoint" in done.stdout and "AutoModelForCausalLM" in done.stdout


def test_an_export_that_loses_the_race_leaves_the_winners_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rename = os.rename

    def another_export_wins(src: Path, dst: Path) -> None:
        Path(dst).mkdir()
        (Path(dst) / "theirs").write_text("first")
        rename(src, dst)

    monkeypatch.setattr(hf.os, "rename", another_export_wins)
    with pytest.raises(ConfigError, match="written meanwhile"):
        hf.write_hf_model(tmp_path / "e", GPT_SMALL, random_model(GPT_SMALL).state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["e"] and [p.name for p in (tmp_path / "e").iterdir()] == ["theirs"]
