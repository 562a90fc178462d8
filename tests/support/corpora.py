"""A user's corpus and tokenizer, built the way a user would: a byte-level BPE whose vocabulary does not
fit uint16 (trained here with the ``tokenizers`` library) and documents of its words."""

from __future__ import annotations

import random
from pathlib import Path

LARGE_VOCAB = 70_000
"""More than 65,536: the ids are stored as uint32."""


def words(seed: int = 15, count: int = 80_000) -> list[str]:
    """About ``count`` distinct lowercase words (enough merges for a 70,000-token BPE)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return sorted({"".join(rng.choice(letters) for _ in range(rng.randint(5, 9))) for _ in range(count)})


def train_bpe(path: Path, vocabulary: list[str], vocab_size: int = LARGE_VOCAB) -> Path:
    """A byte-level BPE of exactly ``vocab_size`` tokens (``<|endoftext|>`` its special token), saved as
    a Hugging Face tokenizer.json at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [" ".join(vocabulary[i : i + 50]) for i in range(0, len(vocabulary), 50)]
    tok.train_from_iterator(lines * 2, trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def documents(vocabulary: list[str], count: int = 600, seed: int = 16) -> list[str]:
    """``count`` documents of 1–40 of the words, with punctuation, dashes and newlines."""
    rng = random.Random(seed)
    punctuation = ["", ".", ",", "!", " —", "\n"]
    return [
        " ".join(rng.choice(vocabulary) + rng.choice(punctuation) for _ in range(rng.randint(1, 40)))
        for _ in range(count)
    ]
