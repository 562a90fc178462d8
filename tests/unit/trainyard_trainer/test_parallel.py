"""The parallel plan (pure), the gradient norm across layouts, ZeRO-1 state, pipeline splits."""


import pytest
import torch

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_contract.spec import TrainingSpec
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import ParallelPlan, clip_grad_norm, parallelize, resolve_plan
from trainyard_trainer.pipeline import keep_stage, split_layers
from trainyard.state import OptimizerState
from trainyard_trainer.training import build_optimizer

CONFIG = ModelConfig(vocab_size=40, n_layers=4, n_heads=4, d_model=16, max_seq_len=8)


def plan(world: int = 4, *, local: int = 4, tensor: int = 1, pipeline: int = 1, sharding: str = "ddp",
         config: ModelConfig = CONFIG) -> ParallelPlan:
    return resolve_plan(world_size=world, local_world_size=local, tensor=tensor, pipeline=pipeline,
                        sharding=sharding, activation_checkpointing=False, config=config)


def test_dp_is_what_the_world_leaves_after_tp_and_pp() -> None:
    assert plan(8, tensor=2, local=8).dp == 4 and plan(8, pipeline=2).dp == 4 and plan(4, tensor=2, pipeline=2).dp == 1
    assert plan(4).dp == 4 and plan(4).zero_stage == 0
    assert [plan(2, sharding=s).zero_stage for s in ("ddp", "zero1", "zero2", "fsdp")] == [0, 1, 2, 3]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world": 6, "tensor": 4}, "WORLD_SIZE 6 is not a multiple of parallelism.tensor 4 x parallelism.pipeline 1"),
    ({"world": 3, "tensor": 3, "local": 3}, "must divide the model's nHeads"),
    ({"world": 4, "tensor": 4, "local": 2}, "inside one node"),
    ({"world": 8, "pipeline": 8, "local": 8}, "exceeds the model's 4 layers"),
    ({"world": 4, "pipeline": 2, "sharding": "fsdp"}, "sharding ddp only"),
    ({"world": 8, "pipeline": 2, "tensor": 2, "local": 8}, "3-D"),
    ({"world": 2, "sharding": "zero9"}, "expected one of ddp, zero1, zero2, fsdp"),
])
def test_impossible_plans_say_why(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(**kwargs)


LLAMA = ModelConfig(architecture="llama", vocab_size=40, n_layers=4, n_heads=4, n_kv_heads=2, d_model=16,
                    max_seq_len=8)


def test_llama_takes_every_layout_the_gpt_does() -> None:
    assert (plan(4, config=LLAMA, tensor=2).tp, plan(4, config=LLAMA, pipeline=2).pp) == (2, 2)
    assert plan(4, config=LLAMA, tensor=2, pipeline=2).dp == 1
    assert [plan(2, config=LLAMA, sharding=s).zero_stage for s in ("ddp", "zero1", "zero2", "fsdp")] == [0, 1, 2, 3]


@pytest.mark.parametrize(("config", "tensor", "message"), [
    # 4 query heads would split over 4 ranks, but 2 kv heads cannot: each rank needs its queries' kv head
    (LLAMA, 4, r"parallelism.tensor 4 must divide the model's nHeads \(4\), nKvHeads \(2\) and FFN width \(64\)"),
    (LLAMA.model_copy(update={"n_kv_heads": 1}), 2, r"nKvHeads \(1\)"),
    (LLAMA.model_copy(update={"d_ff": 42}), 4, r"FFN width \(42\)"),
    (CONFIG, 3, r"must divide the model's nHeads \(4\) and FFN width"),  # no kv heads named for MHA
])
def test_tensor_parallelism_must_split_whole_query_and_kv_heads(config: ModelConfig, tensor: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(tensor * 2, local=tensor * 2, tensor=tensor, config=config)
    assert plan(4, tensor=2, config=config.model_copy(update={"n_kv_heads": None, "d_ff": None})).tp == 2


def test_tensor_parallel_with_data_parallel_shards_dp_with_fsdp() -> None:
    p = plan(4, tensor=2, sharding="ddp")
    assert (p.dp, p.tp, p.sharding) == (2, 2, "fsdp") and "DDP" in p.notes[0]
    assert plan(2, tensor=2).sharding == "ddp"  # no dp dimension: nothing to shard


def test_mesh_coordinates_keep_tp_innermost() -> None:
    p = ParallelPlan(dp=2, tp=2, pp=2)
    coords = [p.coordinates(r) for r in range(8)]
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] and coords[4] == (1, 0, 0)
    assert all(p.rank_of(*c) == r for r, c in enumerate(coords))


def test_split_layers() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]


def test_a_pipeline_stage_keeps_its_layers_under_their_own_names() -> None:
    first = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    last = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    keep_stage(first, 0, 2)
    keep_stage(last, 1, 2)
    names0 = {n for n, _ in first.named_parameters()}
    names1 = {n for n, _ in last.named_parameters()}
    assert {"wte.weight", "wpe.weight", "blocks.1.mlp.fc.weight"} <= names0 and "ln_f.weight" not in names0
    assert {"wte.weight", "ln_f.weight", "blocks.3.attn.qkv.weight"} <= names1  # tied head: wte on both ends
    assert not any(n.startswith(("blocks.0.", "blocks.1.", "wpe")) for n in names1)
    whole = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    assert names0 | names1 == {n for n, _ in whole.named_parameters()}


def test_a_llama_pipeline_stage_keeps_its_layers_under_their_own_names() -> None:
    stages = [build_model(LLAMA, seed=0, device=torch.device("cpu")) for _ in range(3)]
    for index, model in enumerate(stages):
        keep_stage(model, index, 3)
    names = [{n for n, _ in m.named_parameters()} for m in stages]
    assert {"embed_tokens.weight", "blocks.1.self_attn.k_proj.weight"} <= names[0]
    assert not names[0] & {"norm.weight", "lm_head.weight"}
    assert {n.split(".")[1] for n in names[1]} == {"2"}  # a middle stage: its layers, nothing else
    assert {"norm.weight", "lm_head.weight", "blocks.3.mlp.down_proj.weight"} <= names[2]
    assert "embed_tokens.weight" not in names[2]  # untied: the head is the last stage's own
    whole = {n for n, _ in build_model(LLAMA, seed=0, device=torch.device("cpu")).named_parameters()}
    assert names[0] | names[1] | names[2] == whole and sum(map(len, names)) == len(whole)


@pytest.mark.parametrize("config", [CONFIG, LLAMA], ids=["gpt2", "llama"])
def test_stages_run_in_sequence_compute_the_whole_models_logits(config: ModelConfig) -> None:
    """Each stage embeds, positions (llama: its own rotary tables) and projects as the whole model."""
    whole = build_model(config, seed=0, device=torch.device("cpu"))
    idx = torch.randint(0, config.vocab_size, (2, config.max_seq_len))
    expected, _ = whole(idx)
    x = idx
    for index in range(3):
        stage = keep_stage(build_model(config, seed=0, device=torch.device("cpu")), index, 3)
        x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_clip_grad_norm_matches_torch() -> None:
    a = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    b = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    x = torch.randint(0, 40, (2, 8))
    for m in (a, b):
        m(x[:, :-1], x[:, 1:])[1].backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
    total = clip_grad_norm(b.parameters(), 0.5)
    torch.testing.assert_close(total, expected)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    before = [p.grad.clone() for p in b.parameters()]
    clip_grad_norm(b.parameters(), None)  # measure only
    assert all(torch.equal(p.grad, g) for p, g in zip(b.parameters(), before, strict=True))


# ----------------------------------------------------------------------------- a world of one


def spec() -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "d@v1", "codeRevision": "x",
        "resources": {"gpuType": "cpu", "gpuCount": 1},
        "training": {"sequenceLength": 7, "microBatchSize": 2, "globalBatchSize": 4, "learningRate": 0.01,
                     "maxSteps": 3},
    })


def test_zero1_keeps_the_weight_decay_groups_and_saves_by_name(world_of_one: None) -> None:
    model = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    pm = parallelize(model, resolve_plan(world_size=1, local_world_size=1, tensor=1, pipeline=1, sharding="zero1",
                                         activation_checkpointing=True, config=CONFIG),
                     rank=0, device=torch.device("cpu"))
    opt = build_optimizer(pm.model, spec(), sharding="zero1")
    assert type(opt).__name__ == "ZeroRedundancyOptimizer"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    x = torch.randint(0, 40, (2, 8))
    pm.module(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    state = OptimizerState(pm.model, opt).state_dict()
    names = {n for n, _ in build_model(CONFIG, seed=0, device=torch.device("cpu")).named_parameters()}
    assert {k.removeprefix("state.").rsplit(".", 1)[0] for k in state if k.startswith("state.")} == names
    assert not any("_checkpoint_wrapped_module" in k or "module." in k.split(".", 1)[0] for k in state)


def test_state_walks_agree_with_torchs_helpers(world_of_one: None) -> None:
    """After the first call, Model/OptimizerState take a direct walk; it must give torch's entries."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from trainyard.state import ModelState, local_optimizer

    for sharding, checkpointing in (("ddp", False), ("zero1", True)):
        model = build_model(CONFIG, seed=0, device=torch.device("cpu"))
        pm = parallelize(model, resolve_plan(world_size=1, local_world_size=1, tensor=1, pipeline=1,
                                             sharding=sharding, activation_checkpointing=checkpointing, config=CONFIG),
                         rank=0, device=torch.device("cpu"))
        opt = build_optimizer(pm.model, spec(), sharding=sharding)
        x = torch.randint(0, 40, (2, 8))
        pm.module(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        model_state, opt_state = ModelState(pm.module), OptimizerState(pm.module, opt)
        for _ in range(2):
            walked_model, walked_opt = model_state.state_dict(), opt_state.state_dict()
        assert model_state._fast and opt_state._fast
        reference = get_model_state_dict(pm.module)
        assert walked_model.keys() == reference.keys()
        assert all(torch.equal(walked_model[k], v) for k, v in reference.items())
        full = get_optimizer_state_dict(pm.module, local_optimizer(opt),
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
        assert walked_opt.keys() == {k for k in full if k.startswith("state.")}
        assert all(walked_opt[k] is full[k] or torch.equal(walked_opt[k], full[k]) for k in walked_opt)
