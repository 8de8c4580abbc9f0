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
    return moved_off_init(model)


def moved_off_init(model, scale: float = 0.05):
    """`model` with N(0, scale^2) added to every parameter (torch's global generator), so that
    no weight, bias or norm gain keeps its initial value: a mapping that drops or misplaces one
    shows in the outputs."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def save_gpt2_directory(directory: Path, model, tokenizer) -> Path:
    """model.save_pretrained + tokenizer.json + a tokenizer_config.json like OpenAI's GPT-2 files."""
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    n_positions = model.config.n_positions
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": n_positions}))
    return directory


# ----------------------------------------------------------------------------- the Llama family

# Test-size transformers configs of the Llama family, each with its own corners: Llama with llama3
# rope scaling, attention and MLP biases and tied embeddings; Qwen2 with its q/k/v biases, untied,
# a vocabulary padded past the tokenizer's; Qwen3 with QK-norm, a head width other than
# d_model / n_heads, multi-query attention (one key/value head), padded and tied; Mistral untied.
FAMILY_SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-6}  # fmt: skip
FAMILY_VARIANTS = {
    "llama": {"rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
              "sliding_window": 16, "padded": 16},
    "qwen3": {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": 24, "num_key_value_heads": 1,
              "padded": 16},
    "mistral": {"rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": None},
}  # fmt: skip


def random_family_model(model_type: str, vocab_size: int, eos_id: int, n_positions: int = 64, seed: int = 0,
                        **changes):  # fmt: skip
    """A transformers model of FAMILY_VARIANTS[model_type] (with `changes` to its config) whose every
    weight, bias and norm gain is moved off its initial value; its vocabulary is `vocab_size` plus
    the variant's padding rows."""
    import transformers

    transformers.logging.set_verbosity_error()
    variant = {**FAMILY_SIZES, **FAMILY_VARIANTS[model_type], **changes}
    padded = variant.pop("padded", 0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab_size + padded, max_position_embeddings=n_positions,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, **variant,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return moved_off_init(model)


def save_family_directory(directory: Path, model, tokenizer, max_shard_size: str | None = None) -> Path:
    """save_pretrained (in shards with their index when max_shard_size is given), the tokenizer.json
    and a tokenizer_config.json naming the end-of-text token, as Qwen's and Llama's files do."""
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": EOS, "pad_token": EOS, "model_max_length": model.config.max_position_embeddings}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory
