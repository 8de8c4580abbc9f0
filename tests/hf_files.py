"""Hugging Face files made in the tests, offline: a GPT-2-style byte-level BPE trained with the
`tokenizers` package, and a random GPT2LMHeadModel saved with `save_pretrained`, laid out like a
local copy of OpenAI's GPT-2 (config.json, model.safetensors, tokenizer.json, and a
tokenizer_config.json that names no special token: GPT-2's `<|endoftext|>` is implied)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def train_byte_level_bpe(texts: list[str], vocab_size: int):
    """GPT-2's tokenizer layout (byte-level pre-tokenizer and decoder, no prefix space) trained on
    `texts`, with `<|endoftext|>` added last (GPT-2's id 50256 is its last too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def random_gpt2(vocab_size: int, eos_id: int, n_positions: int = 32, seed: int = 0, **sizes):
    """A GPT2LMHeadModel (n_embd 32, 2 layers, 2 heads unless given) with every weight, bias and
    norm gain moved off its initial value, so a mapping that drops or misplaces one shows."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        **{"n_embd": 32, "n_layer": 2, "n_head": 2, **sizes},
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def save_gpt2_directory(directory: Path, model, tokenizer) -> Path:
    """model.save_pretrained + tokenizer.json + a tokenizer_config.json like OpenAI's GPT-2 files."""
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    n_positions = model.config.n_positions
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": n_positions}))
    return directory
