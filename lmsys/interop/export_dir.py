"""The export format: a self-contained model directory written from a checkpoint or from weights,
loaded back by every tool (lmsys-export, lmsys-generate, lmsys-eval, lm_eval, model.init_from).

An export directory (format=lmsys) holds:
- `model.safetensors`: the weights keyed like `Transformer.state_dict()`, in `dtype`; a tied
  embedding is stored ONCE (`tok_emb.weight`) and re-tied on load; the safetensors header
  metadata carries the export's provenance (`lmsys_meta`, JSON);
- `config.json`: the model config dict (`model_config_from_dict` rebuilds the model from it);
- the tokenizer the checkpoint was trained with (sha256-checked, lmsys.data.tokenizer): lmsys's
  `tokenizer.model`, or a Hugging Face `tokenizer.json` with its `tokenizer_config.json`;
- `README.md`: a model card (preset, steps, tokens seen, final train and validation loss).
format=hf writes a directory that transformers' `AutoModelForCausalLM.from_pretrained` loads, for
configs with GPT-2's function (`config.json` a GPT2Config: lmsys/interop/hf.py) or the Llama family's
(a LlamaConfig, Qwen2Config, Qwen3Config or MistralConfig: lmsys/interop/hf_llama.py), and that
`AutoTokenizer.from_pretrained` loads with lmsys's ids: a SentencePiece tokenizer gets a
`tokenizer.json` and `tokenizer_config.json` beside its `tokenizer.model` (lmsys/interop/hf_tokenizer.py,
checked on a broad sample of text before anything is written).

The directory is written under a temporary name next to `out` and renamed into place when
complete; after writing, the export is loaded back and its logits compared with the
consolidated checkpoint's (verify=true).

`load_export(dir) -> (Transformer, Tokenizer, meta)` reads either format with safetensors only,
checks every tensor name and shape against config.json (naming the first mismatch) and the
tokenizer against the model. `load_model(path)` also accepts a checkpoint (used by
lmsys-generate and lmsys-eval). `initial_model(dir, cfg, sha)` is what `model.init_from=dir`
starts a training run with: the export's weights, once its function and tokenizer are the run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from lmsys.core.config import ModelConfig, model_config_from_dict, model_dims, tokenizer_size
from lmsys.core.console import warn as console_warn
from lmsys.core.errors import ConfigError, DataError, ExportError, UsageError
from lmsys.core.files import fsync_files, install_dir, sibling, space_checked, usual_permissions
from lmsys.core.runtime import dtype_name
from lmsys.data.tokenizer import HF_TOKENIZER_CONFIG, TOKENIZER_FILES, Tokenizer, tokenizer_file
from lmsys.engine.checkpoint import model_differences, read_checkpoint, resolve
from lmsys.interop import hf, hf_llama
from lmsys.interop.hf_tokenizer import write_transformers_tokenizer
from lmsys.model.transformer import Transformer
from lmsys.model.weights import TIED_KEY, build_model, check_tensors, expected_shapes, read_safetensors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
FORMAT = "lmsys-export"
FORMAT_VERSION = 1
FORMATS = ("lmsys", "hf")
# Every name an export directory may hold (either format): anything else there is the user's.
EXPORT_FILES = frozenset(
    {WEIGHTS_FILE, CONFIG_FILE, CARD_FILE, *TOKENIZER_FILES, HF_TOKENIZER_CONFIG, hf.GENERATION_CONFIG_FILE}
)
# load_model's option for checkpoints, in every command that loads a model.


# ----------------------------------------------------------------------------- writing an export


def model_card(
    cfg: ModelConfig, info: dict[str, Any], fmt: str, dtype: torch.dtype, n_params: int, tok: Tokenizer
) -> str:
    def num(value: Any, spec: str = ",") -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.4f}"
        return format(value, spec)

    val = num(info.get("val_loss"))
    if info.get("val_loss") is not None and info.get("val_step") is not None:
        val += f" (at step {info['val_step']:,}; perplexity {math.exp(min(info['val_loss'], 80.0)):.2f})"
    train_loss = num(info.get("train_loss"))
    rows = [
        ("preset", f"`{cfg.name}`"),
        ("parameters", f"{n_params:,}"),
        (
            "architecture",
            f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
            f"context {cfg.max_seq_len}, vocabulary {cfg.vocab_size}",
        ),
        ("optimizer steps", num(info.get("step"))),
        ("tokens seen", num(info.get("tokens_seen"))),
        ("final train loss", train_loss),
        ("final validation loss", val),
        (
            "trained with",
            f"DeepSpeed ZeRO stage {num(info.get('zero_stage'))} on {num(info.get('world_size'))} "
            f"process(es), {info.get('precision') or 'n/a'}",
        ),
        (
            "weights",
            f"{WEIGHTS_FILE}, {dtype_name(dtype)}"
            + (", tied embedding stored once" if cfg.tied_embeddings else ""),
        ),
        ("tokenizer", _tokenizer_row(tok, fmt)),
        *([("fine-tuned from", f"`{info['init_from']}`")] if info.get("init_from") else []),
        ("source checkpoint", f"`{info.get('source') or 'n/a'}`"),
        ("exported", time.strftime("%Y-%m-%d %H:%M:%S")),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    fmt_line = f"Hugging Face format, {hf_class(cfg)}" if fmt == "hf" else "lmsys export format"
    made = (
        f"imported into lmsys from `{info['imported_from']}`"
        if info.get("imported_from")
        else "trained with lmsys"
    )
    return (
        f"# {cfg.name} ({info.get('run') or 'lmsys model'})\n\n"
        f"A decoder transformer language model {made} ({fmt_line}).\n\n"
        f"| | |\n|---|---|\n{table}\n\n## Loading\n\n{_loading(fmt, hf_class(cfg))}"
    )


def _tokenizer_row(tok: Tokenizer, fmt: str) -> str:
    eos = f"eos `{tok.special_tokens['eos']}` = {tok.eos_id}"
    if tok.kind == "hf":
        return f"{tok.file_name} (Hugging Face tokenizers, {eos}, sha256 {tok.sha256[:16]})"
    also = ", and as tokenizer.json for transformers" if fmt == "hf" else ""
    return f"{tok.file_name} (SentencePiece BPE, {eos}, sha256 {tok.sha256[:16]}){also}"


def _loading(fmt: str, model_class: str) -> str:
    if fmt != "hf":
        return (
            "```python\nfrom lmsys.export import load_export\n\n"
            'model, tokenizer, meta = load_export("<this directory>")\n```\n'
            'or `python -m lmsys.generate model=<this directory> prompt="..."`.\n'
        )
    return (
        f"```python\nimport torch\nfrom transformers import AutoTokenizer, {model_class}\n\n"
        'tokenizer = AutoTokenizer.from_pretrained("<this directory>")\n'
        f'model = {model_class}.from_pretrained("<this directory>")\n'
        "# lmsys trained every document after an end-of-document token: start a prompt with one\n"
        'ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer("The module")["input_ids"]])\n'
        "out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)\n"
        "print(tokenizer.decode(out[0, 1:], skip_special_tokens=True))\n```\n"
        "The tokenizer gives exactly lmsys's ids; `lmsys.export.load_export` and "
        "`python -m lmsys.generate` also read this directory.\n"
    )


def _metadata(cfg: ModelConfig, info: dict[str, Any], fmt: str, dtype: torch.dtype) -> dict[str, str]:
    meta = {k: v for k, v in info.items() if v is not None}
    meta.update({"dtype": dtype_name(dtype), "format": fmt, "tied_embeddings": cfg.tied_embeddings})
    return {
        "format": "pt",  # what transformers' from_pretrained requires of a safetensors header
        "lmsys_format": FORMAT,
        "lmsys_format_version": str(FORMAT_VERSION),
        "lmsys_meta": json.dumps(meta, sort_keys=True),
        "lmsys_model_config": json.dumps(model_config_dict(cfg), sort_keys=True),
    }


def model_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The model's function as config.json holds it (where a run took its first weights from,
    model.init_from, is provenance: the model card and metadata record it)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(data, dict)
    data.pop("init_from", None)
    return data


def write_export(
    out: str | os.PathLike,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_path: str | os.PathLike,
    info: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    fmt: str = "lmsys",
    overwrite: bool = False,
    verify: bool = True,
) -> Path:
    """Write an export directory atomically (temporary directory, then rename) and return it.

    `state` is keyed like `Transformer.state_dict()` (the tied alias may be present or not).
    With verify, the written directory is loaded back and its logits compared with a model built
    from `state` (equal for fp32; the same rounding for bf16/fp16)."""
    if fmt not in FORMATS:
        raise UsageError(f"format={fmt!r} is not valid; choose one of: {', '.join(FORMATS)}")
    out = Path(out)
    info = publishable(dict(info or {}))
    tok = matching_tokenizer(Path(tokenizer_path), cfg)
    info.setdefault("tokenizer_sha256", tok.sha256)
    state = {k: v for k, v in state.items() if not (cfg.tied_embeddings and k == TIED_KEY)}
    check_tensors(state, expected_shapes(cfg), where="the weights")
    stored = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()
    }
    check_replaceable(out, overwrite, fmt, info.get("run_id"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(out, "tmp")
    tmp.mkdir()
    needed = sum(t.numel() * t.element_size() for t in stored.values()) + Path(tok.path).stat().st_size
    then = f"nothing written to out={out}; free space or choose another out="
    try:
        with space_checked(out.parent, needed, tmp, then):
            _write_files(tmp, cfg, stored, tok, info, dtype, fmt)
        if verify:
            verify_export(tmp, cfg, state, dtype)
        usual_permissions(tmp)
        fsync_files(tmp)  # durability before the rename makes it visible
        install_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def publishable(info: dict[str, Any]) -> dict[str, Any]:
    """`info` without the absolute local paths a published model would leak (home and cluster
    directories): the run directory becomes `run_id`, a digest that only tells whether two exports
    come from the same run; the checkpoint it came from (`source`) becomes `<run name>/<path in
    the run>`; `imported_from`, `init_from` and any other absolute path their last component."""
    run_dir = info.pop("run_dir", None)
    if run_dir is not None:
        info["run_id"] = hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    for key in ("source", "imported_from", "init_from"):
        value = info.get(key)
        if not isinstance(value, str) or not Path(value).is_absolute():
            continue
        path = Path(value)
        if run_dir is not None and path.is_relative_to(run_dir):
            info[key] = str(Path(Path(run_dir).name) / path.relative_to(run_dir))
        else:
            info[key] = path.name
    return info


def check_replaceable(out: Path, overwrite: bool, fmt: str, run_id: str | None) -> None:
    """An existing `out` is replaced only when it holds nothing an export does not write, and
    either overwrite=true or it is an earlier export of the same run (`run_id`, publishable) in
    the same format; ExportError (one line) otherwise, before anything is written."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"out={out} exists and is not a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ExportError(
            f"out={out} holds {foreign[0]!r}{more}, which lmsys-export did not write: it is never "
            "replaced; move that away or choose another out="
        )
    if overwrite:
        return
    earlier = export_provenance(out)
    earlier_run = publishable({"run_dir": earlier["run_dir"]}) if earlier.get("run_dir") else earlier
    same_run = run_id is not None and earlier_run.get("run_id") == run_id  # (exports before run_id: run_dir)
    if same_run and earlier.get("format") == fmt:
        return  # derived data: re-exporting after more training replaces it
    what = f" (a {earlier['format']}-format export)" if earlier.get("format") else ""
    raise ExportError(f"out={out} already exists{what}; choose another directory or pass overwrite=true")


def export_provenance(directory: Path) -> dict[str, Any]:
    """The provenance an export recorded in its safetensors header (lmsys_meta), or {}."""
    try:
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("lmsys_meta", "{}"))
    except Exception:  # not an export, or not ours: nothing recorded
        return {}
    return meta if isinstance(meta, dict) else {}


def _write_files(
    tmp: Path,
    cfg: ModelConfig,
    stored: dict[str, torch.Tensor],
    tok: Tokenizer,
    info: dict[str, Any],
    dtype: torch.dtype,
    fmt: str,
) -> None:
    metadata = _metadata(cfg, info, fmt, dtype)
    tok.copy_to(tmp, model_max_length=cfg.max_seq_len)  # what lmsys reads back
    if fmt == "hf":
        config_json, tensors = _converter(cfg).to_hf(cfg, stored, tok, dtype)
        _write_json(tmp / hf.GENERATION_CONFIG_FILE, hf.generation_config(tok))
        if tok.kind == "sentencepiece":  # (a tokenizer.json is transformers' own already)
            write_transformers_tokenizer(tmp, tok, model_max_length=cfg.max_seq_len)
    else:
        config_json, tensors = model_config_dict(cfg), stored
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=metadata)
    _write_json(tmp / CONFIG_FILE, config_json)
    n_params = sum(t.numel() for t in stored.values())
    (tmp / CARD_FILE).write_text(model_card(cfg, info, fmt, dtype, n_params, tok), encoding="utf-8")


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


@torch.no_grad()
def verify_export(
    directory: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """Load the written directory back and compare its logits with a model built from `state`
    (rounded to `dtype` like the file): they must be equal (float32 arithmetic both sides)."""
    reference = build_model(cfg, {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()})
    loaded, _, _ = load_export(directory)
    g = torch.Generator().manual_seed(0)
    t = min(cfg.max_seq_len, 16)
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=g)
    want, got = reference(ids), loaded(ids)
    if not torch.allclose(want, got, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item())):
        err = (want - got).abs().max().item()
        raise ExportError(f"the written export's logits differ from the checkpoint's by {err:.3g}")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    fmt: str = "lmsys",
    tokenizer: str | os.PathLike | None = None,
    overwrite: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Checkpoint (any ZeRO stage / world size), or an export in another format → export
    directory. Returns `out`. `warn` reports the damaged checkpoints a resolve passes over."""
    if fmt not in FORMATS:
        raise UsageError(f"format={fmt!r} is not valid; choose one of: {', '.join(FORMATS)}")
    if is_export_dir(checkpoint):
        if tokenizer is not None:
            raise UsageError("tokenizer= is only for checkpoints; an export directory carries its own")
        model, tok, meta = load_export(checkpoint)
        info = {k: v for k, v in meta.items() if k not in ("format", "path", "dtype", "tied_embeddings")}
        info["source"] = str(Path(checkpoint).resolve())
        return write_export(out, model.cfg, model.state_dict(), tok.path, info, dtype, fmt, overwrite, verify)
    ckpt = resolve(checkpoint, warn=warn or (lambda message: console_warn("lmsys-export", message)))
    if fmt == "hf":  # refuse before the (slow) consolidation
        require_hf(ckpt.state.model_config(ckpt.tag_dir))
    loaded = read_checkpoint(ckpt, tokenizer)
    info = {**loaded.info, "init_from": (loaded.train_config.get("model") or {}).get("init_from")}
    return write_export(
        out, loaded.cfg, loaded.state, loaded.tokenizer_path, info, dtype, fmt, overwrite, verify
    )


# ----------------------------------------------------------------------------- loading an export


def is_export_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / WEIGHTS_FILE).is_file() and (p / CONFIG_FILE).is_file()


def load_export(
    directory: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: str | None = None,
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """(Transformer in eval mode, Tokenizer, meta) of an export directory (lmsys or hf format),
    running the kernels `kernels` says (auto, triton, torch; None: the model's model.kernels).

    Checks: the safetensors names and shapes match config.json (ExportError naming the first
    mismatching tensor), the tokenizer has the model's vocabulary size and, when the export
    records one, the tokenizer's sha256."""
    d = Path(directory)
    if not d.is_dir():
        raise ExportError(f"export directory {d} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise ExportError(f"{d} is not an lmsys export: {name} is missing")
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(f"{d} is not an lmsys export: it has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:
        config = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{d / CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{d / CONFIG_FILE} is not a JSON object")
    tensors, metadata = read_safetensors(d / WEIGHTS_FILE)
    meta: dict[str, Any] = {}
    with contextlib.suppress(ValueError, TypeError):
        meta = json.loads(metadata.get("lmsys_meta", "{}"))
    if "model_type" in config:  # a transformers config.json (lmsys's have none)
        cfg, state = transformers_model(
            config, tensors, metadata, str(d / WEIGHTS_FILE), str(d / CONFIG_FILE)
        )
        meta.setdefault("format", "hf")
    else:
        try:
            cfg = model_config_from_dict(config)
        except ConfigError as exc:
            raise ExportError(f"{d / CONFIG_FILE} is not a valid model config: {exc}") from exc
        check_tensors(tensors, expected_shapes(cfg), where="", file_label=str(d / WEIGHTS_FILE))
        state = tensors
        meta.setdefault("format", "lmsys")
    tok = matching_tokenizer(d, cfg)  # tokenizer.model when there is one, else tokenizer.json
    want = meta.get("tokenizer_sha256")
    if want and tok.sha256 != want:
        raise ExportError(
            f"the tokenizer does not match the model: {tok.path} has sha256 {tok.sha256[:12]}, "
            f"the model was trained with {str(want)[:12]}"
        )
    model = build_model(replace(cfg, kernels=kernels or cfg.kernels), state, device=device, dtype=dtype)
    meta["path"] = str(d)
    return model, tok, meta


def load_model(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: str | os.PathLike | None = None,
    warn: Callable[[str], None] | None = None,
    kernels: str | None = None,
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """(model, tokenizer, meta) from an export directory or a training checkpoint (run dir,
    checkpoints/ dir or tag dir, chosen by lmsys.engine.checkpoint's one rule, damaged newer ones
    reported through `warn`; consolidated in memory, nothing written). `kernels` overrides the
    model's model.kernels (auto, triton, torch)."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"model={p} does not exist (expected an export directory or a checkpoint)")
    if is_export_dir(p):
        if tokenizer is not None:
            raise UsageError("tokenizer= is only for checkpoints; an export directory carries its own")
        return load_export(p, device=device, dtype=dtype, kernels=kernels)
    loaded = read_checkpoint(resolve(p, warn=warn), tokenizer)
    tok = matching_tokenizer(loaded.tokenizer_path, loaded.cfg)
    cfg = replace(loaded.cfg, kernels=kernels or loaded.cfg.kernels)
    model = build_model(cfg, loaded.state, device=device, dtype=dtype)
    meta = {**loaded.info, "format": "checkpoint", "path": str(p), "train_config": loaded.train_config}
    return model, tok, meta


def matching_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer at `path` (a file or a directory holding one), which must have the model's
    vocabulary size."""
    tok = Tokenizer(path)
    if tok.vocab_size != tokenizer_size(cfg):
        key = "vocab_size" if cfg.tokenizer_vocab_size is None else "tokenizer_vocab_size"
        raise ExportError(
            f"the tokenizer does not match the model: {tok.path} has {tok.vocab_size} pieces, "
            f"model.{key}={tokenizer_size(cfg)}"
        )
    return tok


# Model keys that name or initialise a model without changing its function: the export's weights
# replace the initialisation, and a fine-tuned model may carry another name.
_INIT_FROM_IGNORED = frozenset(
    {"model.name", "model.init_std", "model.hf_model_type", "model.tokenizer_vocab_size"}
)


def _function_dict(cfg: ModelConfig) -> dict[str, Any]:
    """model_config_dict with the widths and scale a config leaves unset (None) filled in with the
    values they mean, so that `ffn.d_ff: null` and `ffn.d_ff: 4 * d_model` compare equal."""
    data = model_config_dict(cfg)
    dims = model_dims(cfg)
    data["ffn"]["d_ff"] = dims.d_ff
    data["attention"].update(d_qk=dims.d_qk, d_vo=dims.d_vo, scale=dims.attention_scale)
    return data


_BLOCKS = {"pre": "pre-LN", "post": "post-LN", "parallel": "parallel blocks", "none": "no norm"}


def architecture(cfg: ModelConfig) -> str:
    """`tiny (pre-LN, 2 layers, d_model 32, 2 heads)`: a model's preset and shape, in words."""
    block = _BLOCKS.get(cfg.block, f"block={cfg.block}")
    return f"{cfg.name} ({block}, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads)"


def initial_model(directory: str | os.PathLike, cfg: ModelConfig, data_tokenizer_sha256: str) -> Transformer:
    """The model a run with `model.init_from=directory` starts from: the export's weights in a
    Transformer of the run's config `cfg` (in training mode). Refused with one line when the
    export's model computes another function than `cfg` (compared like a resume, beyond the
    implementation choices, the name and init_std) or was trained with another tokenizer than
    the data's."""
    d = Path(directory)
    if not is_export_dir(d):
        raise ConfigError(
            f"model.init_from={directory} is not an export directory (model.safetensors and config.json: "
            "lmsys-export or lmsys-import writes one)"
        )
    exported, tok, _ = load_export(d)
    shown = model_differences(
        model_config_dict(exported.cfg), model_config_dict(cfg), "export", _INIT_FROM_IGNORED
    )
    if shown and model_differences(_function_dict(exported.cfg), _function_dict(cfg), "", _INIT_FROM_IGNORED):
        if " more" in shown:  # many settings differ: another architecture, said by its presets
            shown = (
                f"the export is {architecture(exported.cfg)}, the run is {architecture(cfg)}; choose "
                f"model={exported.cfg.name} (with the export's sizes) or an export of this architecture"
            )
        raise ConfigError(f"model.init_from={directory}: the run's model differs from the export's: {shown}")
    if tok.sha256 != data_tokenizer_sha256:
        raise DataError(
            f"model.init_from={directory} was trained with tokenizer {tok.path} (sha256 {tok.sha256[:12]}) "
            f"but the data was encoded with sha256 {data_tokenizer_sha256[:12]}; prepare it with "
            f"data.tokenizer={directory}"
        )
    model = build_model(cfg, exported.state_dict())
    model.train()
    return model


# ----------------------------------------------------------------------------- transformers checkpoints

TRANSFORMERS_TYPES = ("gpt2", *hf_llama.MODEL_TYPES)  # the model_type values lmsys reads


def _converter(cfg: ModelConfig):  # noqa: ANN202 (a module: hf or hf_llama)
    """The module that maps `cfg` to transformers: the Llama family's for rotary models, GPT-2's else."""
    return hf_llama if cfg.positions.kind == "rotary" else hf


def require_hf(cfg: ModelConfig) -> None:
    """ExportError naming the first option format=hf cannot express for `cfg`."""
    if cfg.positions.kind == "rotary":
        hf_llama.require_family(cfg)
    else:
        hf.require_gpt2(cfg)


def hf_class(cfg: ModelConfig) -> str:
    """The transformers class format=hf writes for `cfg` (GPT2LMHeadModel, LlamaForCausalLM, ...)."""
    if cfg.positions.kind == "rotary":
        return hf_llama.ARCHITECTURES[hf_llama.model_type_for(cfg)]
    return "GPT2LMHeadModel"


def transformers_model(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    label: str,
    config_label: str,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The lmsys config and state dict of a transformers checkpoint (its config.json, tensors and
    safetensors metadata), gpt2 or the Llama family; the lmsys config recorded by a format=hf
    export is used when present."""
    recorded = metadata.get("lmsys_model_config")
    if config.get("model_type") == "gpt2":
        cfg = hf.model_config_from_hf(config, recorded)
        return cfg, hf.from_hf(cfg, tensors, label=label)
    cfg = hf_llama.model_config_from_hf(config, recorded, label=config_label)
    return cfg, hf_llama.from_hf(cfg, tensors, label=label)


def read_hf_checkpoint(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], bool]:
    """(lmsys config, state dict, whether the config was recorded by lmsys) of a transformers
    checkpoint directory (`save_pretrained`'s config.json and weights) of a model_type lmsys reads."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{directory} has no config.json: it is not a transformers checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path} is not valid JSON ({exc})") from exc
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in TRANSFORMERS_TYPES:
        raise ExportError(
            f"{path} has model_type {kind!r}; lmsys reads checkpoints of model_type "
            f"{', '.join(TRANSFORMERS_TYPES)}"
        )
    tensors, metadata, label = hf.read_hf_weights(directory)
    cfg, state = transformers_model(config, tensors, metadata, label, str(path))
    return cfg, state, bool(metadata.get("lmsys_model_config"))


def import_checkpoint(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    verify: bool = True,
) -> Path:
    """Write the lmsys export of a transformers directory (GPT-2, Llama, Qwen2, Qwen3, Mistral);
    returns `out`. A tokenizer with fewer pieces than the model's vocabulary (Qwen pads its
    embedding) is recorded as the model's model.tokenizer_vocab_size."""
    source = Path(hf_dir).expanduser()
    if not source.is_dir():
        raise ExportError(f"{source} is not a directory (expected a transformers checkpoint directory)")
    cfg, state, recorded = read_hf_checkpoint(source)
    if not recorded:  # name it after its directory
        cfg = replace(cfg, name=re.sub(r"[^A-Za-z0-9._-]+", "-", source.resolve().name) or cfg.name)
    tok_path = tokenizer_file(tokenizer if tokenizer is not None else source)
    pieces = Tokenizer(tok_path).vocab_size
    if cfg.tokenizer_vocab_size is None and pieces < cfg.vocab_size:
        cfg = replace(cfg, tokenizer_vocab_size=pieces)
    info = {"imported_from": str(source.resolve()), "source": str(source.resolve())}
    return write_export(out, cfg, state, tok_path, info, dtype, "lmsys", overwrite, verify)
