"""Hugging Face model directories made by transformers itself (not by trainyard), for initFrom.huggingFace
and ``trainyard models import``: a "compatible local checkpoint" as a user would bring one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.hfconfig import hf_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def transformers_model(config: ModelConfig, *, seed: int) -> Any:
    """A randomly initialised ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` of ``config`` (fp32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoConfig.for_model(**hf_config(config, bos_token_id=0, eos_token_id=0))
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: perturb them so a mix-up shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_transformers_model(directory: Path, config: ModelConfig, *, seed: int, **save: Any) -> Any:
    """:func:`transformers_model` written with ``save_pretrained`` (safetensors) into ``directory``."""
    model = transformers_model(config, seed=seed)
    model.save_pretrained(directory, safe_serialization=True, **save)
    return model


def hf_logits(model: Any, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=idx).logits
