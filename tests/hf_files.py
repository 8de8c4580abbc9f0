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


# ----------------------------------------------------------------------------- chat templates

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
HEADER_START, HEADER_END, END_OF_TURN, BEGIN = (
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|begin|>",
)
CHAT_SPECIALS = [EOS, IM_START, IM_END, HEADER_START, HEADER_END, END_OF_TURN, BEGIN]


def _assistant(turn: str, generation: bool) -> str:
    """An assistant turn's Jinja (what it writes after its header, through its end of turn),
    inside a {% generation %} block when asked (transformers' assistant-token mask then marks it)."""
    return f"{{% generation %}}{turn}{{% endgeneration %}}" if generation else turn


def chatml_template(generation: bool = False) -> str:
    """ChatML, with a default system prompt when the conversation has none (as Qwen2.5's does)."""
    return (
        "{%- if messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}"
        + _assistant("{{- message['content'] + '<|im_end|>' }}", generation)
        + "{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def thinking_template(generation: bool = False) -> str:
    """ChatML whose last assistant turn opens with an empty think block (as Qwen3's does when its
    messages carry no reasoning): the assistant writes it, after the generation prompt."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}"
        + _assistant(
            "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
            "{{- message['content'] + '<|im_end|>' }}",
            generation,
        )
        + "{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def header_template(generation: bool = False) -> str:
    """Llama 3's layout: bos, a header per turn, the content trimmed, an end-of-turn token."""
    return (
        "{{- bos_token }}{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if message['role'] == 'assistant' %}"
        + _assistant("{{- message['content'] | trim + '<|eot_id|>' }}", generation)
        + "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )


CHAT_TEMPLATES = {"chatml": chatml_template, "thinking": thinking_template, "header": header_template}


def train_chat_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (train_byte_level_bpe's layout) with the chat templates' control tokens
    added as special tokens after `<|endoftext|>`."""
    tokenizer = train_byte_level_bpe(texts, vocab_size)
    tokenizer.add_special_tokens(CHAT_SPECIALS[1:])
    return tokenizer


def save_chat_tokenizer(directory: Path, tokenizer, template: str | None, eos: str = IM_END) -> Path:
    """tokenizer.json and a tokenizer_config.json naming its special tokens and `template`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": eos, "pad_token": EOS, "bos_token": BEGIN}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory
