"""lmsys-export: a training checkpoint → a self-contained model directory (safetensors).

    python -m lmsys.export runs/tiny-20250101-120000          # latest checkpoint -> <run>/export
    python -m lmsys.export checkpoint=runs/tiny-20250101-120000 out=exports/tiny
    python -m lmsys.export checkpoint=runs/x/checkpoints/step_0000500 out=exports/x dtype=bf16
    python -m lmsys.export checkpoint=runs/x out=exports/x-hf format=hf      # GPT-2-shaped models

`checkpoint=` is a run directory (its newest complete checkpoint), its `checkpoints/` directory
(the tag in `latest`), or one tag directory (`checkpoints/step_0000500`), of any ZeRO stage and
world size. Without `out=`, a run's export goes to `<run dir>/export` (replacing an earlier
export there, so the command can be re-run after more training). The weights are consolidated
by DeepSpeed's own `zero_to_fp32` functions (stage 0 checkpoints hold the whole module
already), with every `torch.load` forced to `weights_only=True` and a short allowlist of
DeepSpeed's plain data classes: loading never runs code from a pickle.

An export directory (format=lmsys) holds:
- `model.safetensors`: the weights keyed like `Transformer.state_dict()`, in `dtype`; a tied
  embedding is stored ONCE (`tok_emb.weight`) and re-tied on load; the safetensors header
  metadata carries the export's provenance (`lmsys_meta`, JSON);
- `config.json`: the model config dict (`model_config_from_dict` rebuilds the model from it);
- `tokenizer.model`: the SentencePiece model the checkpoint was trained with (sha256-checked);
- `README.md`: a model card (preset, steps, tokens seen, final train and validation loss).
format=hf writes a directory that transformers' `GPT2LMHeadModel.from_pretrained` loads
(`config.json` is then a GPT2Config; see lmsys/hf.py), for configs with GPT-2's function only.

The directory is written under a temporary name next to `out` and renamed into place when
complete; after writing, the export is loaded back and its logits compared with the
consolidated checkpoint's (verify=true).

`load_export(dir) -> (Transformer, Tokenizer, meta)` reads either format with safetensors only,
checks every tensor name and shape against config.json (naming the first mismatch) and the
tokenizer against the model. `load_model(path)` also accepts a checkpoint (used by
lmsys-generate and lmsys-eval).

Errors (a missing or corrupt checkpoint, a mismatching file, a config that format=hf cannot
express) print one line `lmsys-export: error: ...` on stderr and exit 2.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmsys.config import ConfigError, ModelConfig, model_config_from_dict

PROG = "lmsys-export"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
CARD_FILE = "README.md"
FORMAT = "lmsys-export"
FORMAT_VERSION = 1
FORMATS = ("lmsys", "hf")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TIED_KEY = "unembed.weight"  # the alias of tok_emb.weight when model.tied_embeddings
EMBED_KEY = "tok_emb.weight"


class ExportError(ValueError):
    """A bad input to export/load (missing, corrupt or mismatching files); one line."""


# ============================================================================ key=value CLI parsing


@dataclass
class Option:
    """One `key=value` argument of an lmsys tool."""

    name: str
    kind: str  # str | int | float | bool | choice
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    repeat: bool = False  # may be given several times (collected into a list)


class UsageError(ValueError):
    """A command-line mistake; one line."""


def parse_options(
    prog: str, argv: list[str], options: list[Option], summary: str, positional: str | None = None
) -> dict[str, Any] | None:
    """Parse `key=value` arguments. Returns None after printing --help. Raises UsageError.

    Values: bool takes true/false (also 1/0, yes/no); int/float as Python reads them; `none`
    (or an empty value) for an int/float/str option means "unset" (None). With `positional`,
    the first argument may be a bare value for that option (`lmsys-export runs/x` is
    `checkpoint=runs/x`); a path holding '=' can still be given as `key=value`."""
    by_name = {o.name: o for o in options}
    if any(a in ("-h", "--help", "help") for a in argv):
        print(format_help(prog, options, summary, positional))
        return None
    values: dict[str, Any] = {o.name: ([] if o.repeat else o.default) for o in options}
    if positional is not None and argv and "=" not in argv[0] and not argv[0].startswith("-"):
        argv = [f"{positional}={argv[0]}", *argv[1:]]
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep:
            raise UsageError(f"argument {arg!r} is not key=value; run `{prog} --help` for the options")
        opt = by_name.get(key)
        if opt is None:
            raise UsageError(f"unknown option {key!r}; valid options: {', '.join(by_name)}")
        value = _convert(opt, raw)
        if opt.repeat:
            values[key].append(value)
        else:
            values[key] = value
    for o in options:
        if o.repeat and not values[o.name] and o.default:
            values[o.name] = list(o.default)
    return values


def _convert(opt: Option, raw: str) -> Any:
    text = raw.strip()
    if opt.kind == "str":
        return raw if raw != "" else None
    if opt.kind == "choice":
        if text not in opt.choices:
            raise UsageError(f"{opt.name}={raw!r} is not valid; choose one of: {', '.join(opt.choices)}")
        return text
    if opt.kind == "bool":
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{opt.name}={raw!r} is not valid; use true or false")
    if text.lower() in ("", "none", "null"):
        return None
    try:
        return int(text) if opt.kind == "int" else float(text)
    except ValueError:
        kind = "an integer" if opt.kind == "int" else "a number"
        raise UsageError(f"{opt.name}={raw!r} is not valid; it must be {kind}") from None


def format_help(prog: str, options: list[Option], summary: str, positional: str | None = None) -> str:
    usage = (
        f"usage: {prog} [{positional.upper()}] key=value ..."
        if positional
        else f"usage: {prog} key=value ..."
    )
    lines = [summary.rstrip(), "", usage, "", "options:"]
    width = max(len(o.name) for o in options) + 2
    for o in options:
        shown = str(o.default).lower() if isinstance(o.default, bool) else o.default
        default = "" if o.default in (None, [], "") else f" (default: {shown})"
        choices = f" [{'|'.join(o.choices)}]" if o.choices else ""
        repeat = " (repeatable)" if o.repeat else ""
        lines.append(f"  {o.name:<{width}}{o.help}{choices}{default}{repeat}")
    lines.append("")
    lines.append("Errors print one line `" + prog + ": error: ...` on stderr and exit with status 2.")
    return "\n".join(lines)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that are the user's input mistakes (one line, exit 2)."""
    errors: list[type[BaseException]] = [ExportError, UsageError, ConfigError]
    with contextlib.suppress(Exception):
        from lmsys.corpus import DataError

        errors.append(DataError)
    with contextlib.suppress(Exception):
        from lmsys.checkpoint import CheckpointError

        errors.append(CheckpointError)
    with contextlib.suppress(Exception):
        from lmsys import data as data_module

        errors.append(data_module.DataError)
    return tuple(errors)


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a CLI body: user mistakes print one line `prog: error: ...` and return 2."""
    try:
        return body()
    except user_errors() as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130


def resolve_dtype(name: str | None) -> torch.dtype:
    key = DTYPE_ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise UsageError(f"dtype={name!r} is not valid; choose one of: {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def resolve_device(choice: str | None) -> torch.device:
    if choice in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device={choice} but no CUDA device is available; use device=cpu")
    try:
        return torch.device(choice)
    except RuntimeError:
        raise UsageError(f"device={choice!r} is not valid; use auto, cpu or cuda") from None


# ============================================================================ reading checkpoints

# DeepSpeed pickles a few of its own plain data classes into optimizer-state files. They are
# allowlisted for `torch.load(weights_only=True)`, which only rebuilds these types and tensors;
# anything else in a pickle is refused.
_DEEPSPEED_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def _safe_globals() -> list[Any]:
    import importlib

    found = []
    for module, name in _DEEPSPEED_SAFE_GLOBALS:
        with contextlib.suppress(Exception):
            found.append(getattr(importlib.import_module(module), name))
    return found


def safe_torch_load(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool | None = None) -> Any:
    """torch.load with weights_only=True (never unpickles code) and DeepSpeed's data classes."""
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class _WeightsOnlyTorch:
    """Stands in for the `torch` module inside deepspeed.utils.zero_to_fp32 while it runs, so its
    `torch.load(..., weights_only=False)` calls become weights-only loads."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(
        f: Any, map_location: Any = None, weights_only: bool | None = None, mmap: bool | None = None, **_: Any
    ):
        return safe_torch_load(f, map_location=map_location, mmap=mmap)


def _prepare_deepspeed_import() -> None:
    # Without a GPU DeepSpeed would warn that it fell back to its CPU accelerator.
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextlib.contextmanager
def _quiet_and_safe(zero_to_fp32: Any) -> Iterator[io.StringIO]:
    """zero_to_fp32 prints progress to stdout and tqdm bars to stderr: capture both, and make
    its torch.load weights-only for the duration."""
    import logging

    captured = io.StringIO()
    original = zero_to_fp32.torch
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    zero_to_fp32.torch = _WeightsOnlyTorch()
    ds_logger.setLevel(logging.ERROR)
    try:
        with (
            contextlib.redirect_stdout(captured),
            contextlib.redirect_stderr(captured),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield captured
    finally:
        zero_to_fp32.torch = original
        ds_logger.setLevel(level)


@dataclass
class CheckpointRef:
    """One checkpoint tag directory of a run."""

    tag_dir: Path
    state: dict[str, Any]  # the client state from lmsys_checkpoint.json
    run_dir: Path | None

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    @property
    def config(self) -> dict[str, Any]:
        return self.state.get("config") or {}


def _is_tag_dir(path: Path) -> bool:
    from lmsys.checkpoint import MARKER

    return (path / MARKER).is_file() or any(path.glob("*model_states.pt"))


def resolve_checkpoint(path: str | os.PathLike, verify_hashes: bool = True) -> CheckpointRef:
    """A run dir, its checkpoints/ dir or a tag dir → the checkpoint, verified against its marker
    (every file present with its recorded size and, with verify_hashes, sha256)."""
    from lmsys import checkpoint as ckpt

    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise ExportError(f"checkpoint {p} is not a directory")
    tag_dir: Path | None = None
    if _is_tag_dir(p):
        tag_dir = p
    else:
        root = p / ckpt.CHECKPOINTS if (p / ckpt.CHECKPOINTS).is_dir() else p
        latest = root / ckpt.LATEST
        if latest.is_file():
            tag = latest.read_text(encoding="utf-8").strip()
            tag_dir = root / tag
            if not tag_dir.is_dir():
                raise ExportError(f"{latest} names {tag!r}, which does not exist in {root}")
        else:
            found = ckpt.list_checkpoints(root)
            if found:
                tag_dir = found[0][1]
    if tag_dir is None:
        raise ExportError(
            f"{p} is not a checkpoint: expected a run directory, its checkpoints/ directory, or a "
            f"checkpoint tag directory holding {ckpt.MARKER}"
        )
    if not (tag_dir / ckpt.MARKER).is_file():
        raise ExportError(
            f"checkpoint {tag_dir} has no {ckpt.MARKER}: the save did not finish, or it is not an "
            "lmsys checkpoint"
        )
    try:
        marker = ckpt.verify(tag_dir, check_hashes=verify_hashes)
    except ckpt.CheckpointError as exc:
        raise ExportError(f"checkpoint is corrupt: {exc}") from exc
    state = marker.get("state")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise ExportError(f"checkpoint {tag_dir}: {ckpt.MARKER} carries no training config")
    run_dir = tag_dir.parent.parent if tag_dir.parent.name == ckpt.CHECKPOINTS else None
    return CheckpointRef(tag_dir=tag_dir, state=state, run_dir=run_dir)


def list_run_checkpoints(run: str | os.PathLike) -> list[Path]:
    """Every checkpoint tag directory of a run (or of its checkpoints/ dir), oldest first."""
    from lmsys import checkpoint as ckpt

    p = Path(run)
    if not p.is_dir():
        raise ExportError(f"run directory {p} does not exist")
    root = p / ckpt.CHECKPOINTS if (p / ckpt.CHECKPOINTS).is_dir() else p
    found = [path for _, path in sorted(ckpt.list_checkpoints(root))]
    if not found:
        raise ExportError(f"{p} holds no checkpoints (no {ckpt.CHECKPOINTS}/step_* directories)")
    return found


def consolidate(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full-precision weights of a DeepSpeed checkpoint tag, as DeepSpeed consolidates them.

    ZeRO 1-3: `get_fp32_state_dict_from_zero_checkpoint` (the fp32 master weights, merged from
    every rank's partition). Stage 0 has no partitions: the module state in
    mp_rank_00_model_states.pt is the whole model. Keys are the engine module's (prefixed)."""
    _prepare_deepspeed_import()
    try:
        if _zero_stage(tag_dir) >= 1:
            from deepspeed.utils import zero_to_fp32

            with _quiet_and_safe(zero_to_fp32):
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    str(tag_dir.parent), tag=tag_dir.name
                )
        else:
            model_file = tag_dir / "mp_rank_00_model_states.pt"
            if not model_file.is_file():
                raise ExportError(f"checkpoint {tag_dir} has neither ZeRO partitions nor {model_file.name}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = safe_torch_load(model_file)["module"]
    except ExportError:
        raise
    except Exception as exc:  # truncated zip, refused pickle global, DeepSpeed's own checks
        raise ExportError(f"cannot read checkpoint {tag_dir}: {_load_failure(exc)}") from exc
    return dict(state)


def _zero_stage(tag_dir: Path) -> int:
    """The ZeRO stage the checkpoint was saved at: from its lmsys marker, else from its files.
    A bf16 run writes its ZeRO 1-3 partitions as `bf16_zero_pp_rank_*` too, and so does stage 0's
    bf16 optimizer (no partitions: its module state is whole), so file names alone cannot tell."""
    from lmsys import checkpoint as ckpt

    try:
        return int(json.loads((tag_dir / ckpt.MARKER).read_text(encoding="utf-8"))["state"]["zero_stage"])
    except (OSError, ValueError, KeyError, TypeError):
        plain = [f for f in tag_dir.glob("*zero_pp_rank_*_optim_states.pt") if not f.name.startswith("bf16_")]
        return 1 if plain else 0


def _load_failure(exc: BaseException) -> str:
    """One line for a failed checkpoint read; a refused pickle names the object it wanted."""
    import pickle
    import re

    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
        match = re.search(r"GLOBAL (\S+)", text)
        what = match.group(1) if match else "an object that is not plain data"
        return f"it pickles {what}, which lmsys refuses to load (only tensors and plain data are unpickled)"
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)


def model_state_dict(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map consolidated engine keys onto `Transformer` keys: strip the engine's wrapper prefix
    (e.g. `model.`), keep a tied embedding once (checking a duplicated copy is identical), and
    check every expected tensor is present with its shape. Returns fp32 (non-float kept)."""
    expected = expected_shapes(cfg)
    prefix = next((k[: -len(EMBED_KEY)] for k in raw if k.endswith(EMBED_KEY)), None)
    if prefix is None:
        raise ExportError(f"the checkpoint has no {EMBED_KEY} tensor: it is not an lmsys Transformer")
    state = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
    if cfg.tied_embeddings and TIED_KEY in state:
        tied = state.pop(TIED_KEY)
        if tied.shape != state[EMBED_KEY].shape or not torch.equal(tied.float(), state[EMBED_KEY].float()):
            raise ExportError(
                f"the checkpoint's {TIED_KEY} differs from {EMBED_KEY} although "
                "model.tied_embeddings=true (the shared tensor was not consolidated as one)"
            )
    check_tensors(state, expected, where="the checkpoint")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def _config_of(ref: CheckpointRef) -> ModelConfig:
    model = ref.config.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"checkpoint {ref.tag_dir}: its config has no model section")
    try:
        return model_config_from_dict(model)
    except ConfigError as exc:
        raise ExportError(f"checkpoint {ref.tag_dir}: its model config is invalid: {exc}") from exc


def find_tokenizer(ref: CheckpointRef, explicit: str | os.PathLike | None = None) -> Path:
    """The tokenizer.model a checkpoint was trained with: `explicit`, else one next to the
    checkpoint or run, else the prepared data dir of its config (data.tokenizer, data.dir);
    its sha256 must be the one recorded in the checkpoint."""
    from lmsys.tokenizer import file_sha256

    want = ref.state.get("tokenizer_sha256")
    data = ref.config.get("data") or {}
    if explicit is not None:
        candidates = [Path(explicit)]
    else:
        candidates = [ref.tag_dir / TOKENIZER_FILE]
        if ref.run_dir is not None:
            candidates.append(ref.run_dir / TOKENIZER_FILE)
        if data.get("dir"):
            candidates.append(Path(data["dir"]) / TOKENIZER_FILE)
            if ref.run_dir is not None and not Path(data["dir"]).is_absolute():
                candidates.append(ref.run_dir.parent.parent / data["dir"] / TOKENIZER_FILE)
        if data.get("tokenizer"):
            candidates.append(Path(data["tokenizer"]))
    seen = []
    for cand in candidates:
        if not cand.is_file():
            if explicit is not None:
                raise ExportError(f"tokenizer={cand} does not exist")
            continue
        sha = file_sha256(cand)
        if want is None or sha == want:
            return cand
        seen.append(f"{cand} (sha256 {sha[:12]})")
    if seen:
        raise ExportError(
            f"the tokenizer does not match the model: the checkpoint was trained with sha256 "
            f"{str(want)[:12]}, found {', '.join(seen)}; pass tokenizer=<the data dir's tokenizer.model>"
        )
    raise ExportError(
        f"cannot find the tokenizer of checkpoint {ref.tag_dir} (looked in the checkpoint, the run and "
        f"data.dir={data.get('dir')!r}); pass tokenizer=<path to tokenizer.model>"
    )


def run_summary(ref: CheckpointRef) -> dict[str, Any]:
    """Provenance of a checkpoint for the model card: steps, tokens, final losses."""
    state = ref.state
    info: dict[str, Any] = {
        "step": state.get("step"),
        "tokens_seen": state.get("tokens_seen"),
        "train_loss": state.get("last_loss"),
        "val_loss": None,
        "val_step": None,
        "zero_stage": state.get("zero_stage"),
        "world_size": state.get("world_size"),
        "precision": state.get("precision"),
        "tokenizer_sha256": state.get("tokenizer_sha256"),
        "source": str(ref.tag_dir),
        "run": ref.run_dir.name if ref.run_dir is not None else None,
    }
    if ref.run_dir is not None:
        records = _read_metrics(ref.run_dir)
        step = info["step"] if info["step"] is not None else math.inf
        train = [r for r in records if r.get("kind") == "train" and r.get("step", math.inf) <= step]
        evals = [r for r in records if r.get("kind") == "eval" and r.get("step", math.inf) <= step]
        finite_train = [r for r in train if isinstance(r.get("loss"), (int, float))]
        if info["train_loss"] is None and finite_train:
            info["train_loss"] = finite_train[-1]["loss"]
        if info["tokens_seen"] is None and train and train[-1].get("tokens") is not None:
            info["tokens_seen"] = train[-1]["tokens"]
        finite_eval = [r for r in evals if isinstance(r.get("loss"), (int, float))]
        if finite_eval:
            info["val_loss"] = finite_eval[-1]["loss"]
            info["val_step"] = finite_eval[-1]["step"]
    return info


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
    return records


@dataclass
class LoadedCheckpoint:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]  # Transformer keys, tied embedding once, fp32
    tokenizer_path: Path
    info: dict[str, Any] = field(default_factory=dict)


def read_checkpoint(
    path: str | os.PathLike | CheckpointRef, tokenizer: str | os.PathLike | None = None
) -> LoadedCheckpoint:
    """A checkpoint's model config, consolidated weights (Transformer keys), tokenizer and
    provenance; nothing is written."""
    ref = path if isinstance(path, CheckpointRef) else resolve_checkpoint(path)
    cfg = _config_of(ref)
    tokenizer_path = find_tokenizer(ref, tokenizer)
    state = model_state_dict(consolidate(ref.tag_dir), cfg)
    return LoadedCheckpoint(cfg=cfg, state=state, tokenizer_path=tokenizer_path, info=run_summary(ref))


# ============================================================================ the model from tensors


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Skips the in-place initialisers while a model is built whose weights are loaded right
    after: its parameters stay uninitialised `torch.empty` memory, which the OS does not even
    commit until written. (A meta-device model would be lighter still, but computing the
    sinusoidal tables or initialising on meta imports torch._dynamo: seconds of start-up for
    every lmsys-generate / lmsys-eval call.)"""

    SKIP = frozenset({"normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_",
                      "trunc_normal_", "kaiming_uniform_", "xavier_uniform_"})  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.SKIP:
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def skeleton(cfg: ModelConfig):
    """A Transformer of `cfg` with uninitialised parameters (shapes and fixed buffers only)."""
    from lmsys.model import Transformer

    with _SkipInit():
        return Transformer(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor an export stores for `cfg` (tied embedding once)."""
    model = skeleton(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tied_embeddings:
        shapes.pop(TIED_KEY, None)
    return shapes


def check_tensors(
    tensors: dict[str, Any], expected: dict[str, tuple[int, ...]], where: str, file_label: str = ""
) -> None:
    """Raise ExportError naming the first tensor whose name or shape disagrees with `expected`."""
    label = file_label or where
    for name, shape in expected.items():
        if name not in tensors:
            raise ExportError(f"{label} has no tensor {name!r} (shape {list(shape)}) that the config needs")
        got = tuple(tensors[name].shape) if hasattr(tensors[name], "shape") else tuple(tensors[name])
        if got != shape:
            raise ExportError(
                f"{label}: tensor {name!r} has shape {list(got)}, the config needs {list(shape)}"
            )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise ExportError(f"{label} has a tensor {extra[0]!r} that the config does not define")


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """A Transformer holding exactly `state` (checked names and shapes), tied weights re-tied.
    A tied model's state may carry the alias unembed.weight (as `state_dict()` does) if it is
    the embedding itself."""
    if cfg.tied_embeddings and TIED_KEY in state and EMBED_KEY in state:
        if not torch.equal(state[TIED_KEY], state[EMBED_KEY]):
            raise ExportError(f"{TIED_KEY} differs from {EMBED_KEY} although model.tied_embeddings=true")
        state = {k: v for k, v in state.items() if k != TIED_KEY}
    check_tensors(state, expected_shapes(cfg), where="the weights")
    model = skeleton(cfg)
    # The model's tensors become copies of `state` (assign: the uninitialised ones are replaced,
    # never written); copies, so the model shares no memory with the caller's tensors.
    owned = {
        k: v.detach().to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state.items()
    }
    missing, unexpected = model.load_state_dict(owned, strict=False, assign=True)
    allowed_missing = {TIED_KEY} if cfg.tied_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ExportError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if cfg.tied_embeddings:
        model.unembed.weight = model.tok_emb.weight  # assign replaced the shared Parameter: re-tie
    model.to(device=device, dtype=dtype)  # anything not in `state` (non-persistent buffers)
    model.eval()
    return model


# ============================================================================ writing an export


def _tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def model_card(cfg: ModelConfig, info: dict[str, Any], fmt: str, dtype: torch.dtype, n_params: int) -> str:
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
    loading = (
        "```python\nfrom lmsys.export import load_export\n\n"
        'model, tokenizer, meta = load_export("<this directory>")\n```\n'
        'or `python -m lmsys.generate model=<this directory> prompt="..."`.\n'
    )
    if fmt == "hf":
        loading = (
            "```python\nfrom transformers import GPT2LMHeadModel\n\n"
            'model = GPT2LMHeadModel.from_pretrained("<this directory>")\n```\n'
            "The tokenizer is the SentencePiece model `tokenizer.model` (lmsys.tokenizer.Tokenizer or "
            "sentencepiece); `lmsys.export.load_export` also reads this directory.\n"
        )
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
        (
            "tokenizer",
            f"{TOKENIZER_FILE} (SentencePiece BPE, sha256 {str(info.get('tokenizer_sha256'))[:16]})",
        ),
        ("source checkpoint", f"`{info.get('source') or 'n/a'}`"),
        ("exported", time.strftime("%Y-%m-%d %H:%M:%S")),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    fmt_line = "Hugging Face GPT-2 format" if fmt == "hf" else "lmsys export format"
    return (
        f"# {cfg.name} ({info.get('run') or 'lmsys model'})\n\n"
        f"A decoder transformer language model trained with lmsys ({fmt_line}).\n\n"
        f"| | |\n|---|---|\n{table}\n\n## Loading\n\n{loading}"
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
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(data, dict)
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
    from safetensors.torch import save_file

    from lmsys.tokenizer import Tokenizer, file_sha256

    if fmt not in FORMATS:
        raise UsageError(f"format={fmt!r} is not valid; choose one of: {', '.join(FORMATS)}")
    out = Path(out)
    info = dict(info or {})
    tokenizer_path = Path(tokenizer_path)
    tok = Tokenizer(tokenizer_path)
    if tok.vocab_size != cfg.vocab_size:
        raise ExportError(
            f"the tokenizer does not match the model: {tokenizer_path} has {tok.vocab_size} pieces, "
            f"model.vocab_size={cfg.vocab_size}"
        )
    info.setdefault("tokenizer_sha256", file_sha256(tokenizer_path))
    state = {k: v for k, v in state.items() if not (cfg.tied_embeddings and k == TIED_KEY)}
    check_tensors(state, expected_shapes(cfg), where="the weights")
    stored = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()
    }
    if out.exists() and not overwrite:
        raise ExportError(f"out={out} already exists; choose another directory or pass overwrite=true")
    if out.exists() and not out.is_dir():
        raise ExportError(f"out={out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    tmp.mkdir()
    try:
        metadata = _metadata(cfg, info, fmt, dtype)
        if fmt == "hf":
            from lmsys import hf

            hf_config, hf_state = hf.to_hf(cfg, stored, tok, dtype)
            save_file(hf_state, str(tmp / WEIGHTS_FILE), metadata=metadata)
            (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
            (tmp / hf.GENERATION_CONFIG_FILE).write_text(
                json.dumps(hf.generation_config(tok), indent=2) + "\n", encoding="utf-8"
            )
        else:
            save_file(stored, str(tmp / WEIGHTS_FILE), metadata=metadata)
            (tmp / CONFIG_FILE).write_text(
                json.dumps(model_config_dict(cfg), indent=2) + "\n", encoding="utf-8"
            )
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        n_params = sum(t.numel() for t in stored.values())
        (tmp / CARD_FILE).write_text(model_card(cfg, info, fmt, dtype, n_params), encoding="utf-8")
        if verify:
            verify_export(tmp, cfg, state, dtype)
        for f in tmp.iterdir():  # durability before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(3)}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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
) -> Path:
    """Checkpoint (any ZeRO stage / world size) → export directory. Returns `out`."""
    if fmt not in FORMATS:
        raise UsageError(f"format={fmt!r} is not valid; choose one of: {', '.join(FORMATS)}")
    ref = resolve_checkpoint(checkpoint)
    if fmt == "hf":  # refuse before the (slow) consolidation
        from lmsys import hf

        hf.require_gpt2(_config_of(ref))
    loaded = read_checkpoint(ref, tokenizer)
    return write_export(
        out, loaded.cfg, loaded.state, loaded.tokenizer_path, loaded.info, dtype, fmt, overwrite, verify
    )


# ============================================================================ loading an export


def is_export_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / WEIGHTS_FILE).is_file() and (p / CONFIG_FILE).is_file()


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the header metadata of a safetensors file (never unpickles)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise ExportError(f"{path} is not a readable safetensors file ({first})") from exc
    return tensors, metadata


def load_export(
    directory: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
):
    """(Transformer in eval mode, Tokenizer, meta) of an export directory (lmsys or hf format).

    Checks: the safetensors names and shapes match config.json (ExportError naming the first
    mismatching tensor), the tokenizer has the model's vocabulary size and, when the export
    records one, the tokenizer's sha256."""
    from lmsys.tokenizer import Tokenizer

    d = Path(directory)
    if not d.is_dir():
        raise ExportError(f"export directory {d} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (d / name).is_file():
            raise ExportError(f"{d} is not an lmsys export: {name} is missing")
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
    if config.get("model_type") == "gpt2":
        from lmsys import hf

        cfg = hf.model_config_from_hf(config, metadata.get("lmsys_model_config"))
        state = hf.from_hf(cfg, tensors, label=str(d / WEIGHTS_FILE))
        meta.setdefault("format", "hf")
    else:
        try:
            cfg = model_config_from_dict(config)
        except ConfigError as exc:
            raise ExportError(f"{d / CONFIG_FILE} is not a valid model config: {exc}") from exc
        check_tensors(tensors, expected_shapes(cfg), where="", file_label=str(d / WEIGHTS_FILE))
        state = tensors
        meta.setdefault("format", "lmsys")
    tok = Tokenizer(d / TOKENIZER_FILE)
    if tok.vocab_size != cfg.vocab_size:
        raise ExportError(
            f"the tokenizer does not match the model: {d / TOKENIZER_FILE} has {tok.vocab_size} pieces, "
            f"the model's vocab_size is {cfg.vocab_size}"
        )
    want = meta.get("tokenizer_sha256")
    if want and tok.sha256 != want:
        raise ExportError(
            f"the tokenizer does not match the model: {d / TOKENIZER_FILE} has sha256 {tok.sha256[:12]}, "
            f"the model was trained with {str(want)[:12]}"
        )
    model = build_model(cfg, state, device=device, dtype=dtype)
    meta["path"] = str(d)
    return model, tok, meta


def load_model(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: str | os.PathLike | None = None,
):
    """(model, tokenizer, meta) from an export directory or a training checkpoint (run dir,
    checkpoints/ dir or tag dir; consolidated in memory, nothing written)."""
    from lmsys.tokenizer import Tokenizer

    p = Path(path)
    if not p.exists():
        raise ExportError(f"model={p} does not exist (expected an export directory or a checkpoint)")
    if is_export_dir(p):
        if tokenizer is not None:
            raise UsageError("tokenizer= is only for checkpoints; an export directory carries its own")
        return load_export(p, device=device, dtype=dtype)
    loaded = read_checkpoint(p, tokenizer)
    tok = Tokenizer(loaded.tokenizer_path)
    if tok.vocab_size != loaded.cfg.vocab_size:
        raise ExportError(
            f"the tokenizer does not match the model: {loaded.tokenizer_path} has {tok.vocab_size} pieces, "
            f"model.vocab_size={loaded.cfg.vocab_size}"
        )
    model = build_model(loaded.cfg, loaded.state, device=device, dtype=dtype)
    meta = {**loaded.info, "format": "checkpoint", "path": str(p)}
    return model, tok, meta


# ============================================================================ CLI

OPTIONS = [
    Option(
        "checkpoint",
        "str",
        None,
        "run dir (its latest checkpoint), its checkpoints/ dir, or one tag dir (required)",
    ),
    Option("out", "str", None, "export directory to create (default: <run dir>/export)"),
    Option(
        "format",
        "choice",
        "lmsys",
        "lmsys: safetensors + config.json; hf: GPT2LMHeadModel directory",
        FORMATS,
    ),
    Option("dtype", "choice", "fp32", "dtype of the stored weights", tuple(DTYPES)),
    Option(
        "tokenizer", "str", None, "tokenizer.model to use (default: found from the checkpoint's data.dir)"
    ),
    Option("overwrite", "bool", False, "replace an existing out directory"),
    Option("verify", "bool", True, "load the export back and compare logits with the checkpoint"),
]

SUMMARY = (
    "lmsys-export: write a training checkpoint (any ZeRO stage and world size) as a self-contained\n"
    "directory: model.safetensors, config.json, tokenizer.model and a README.md model card.\n"
    "examples: python -m lmsys.export runs/tiny-x          # latest checkpoint -> runs/tiny-x/export\n"
    "          python -m lmsys.export checkpoint=runs/tiny-x out=exports/tiny-x dtype=bf16 format=hf"
)
DEFAULT_OUT = "export"  # out= defaults to <run dir>/export


def default_out(checkpoint: str | os.PathLike) -> Path:
    """<run dir>/export for a checkpoint inside a run (run dir, checkpoints/ dir or tag dir)."""
    ref = resolve_checkpoint(checkpoint, verify_hashes=False)
    if ref.run_dir is None:
        raise UsageError(f"out= is required: checkpoint={checkpoint} is not inside a run directory")
    return ref.run_dir / DEFAULT_OUT


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="checkpoint")
        if opts is None:
            return 0
        if not opts["checkpoint"]:
            raise UsageError(f"checkpoint= is required; run `{PROG} --help` for the options")
        dtype = resolve_dtype(opts["dtype"])
        out, overwrite = opts["out"], opts["overwrite"]
        if not out:
            out = default_out(opts["checkpoint"])
            # The run's own export is derived data: re-exporting (after more training) replaces
            # it, so the main job's one-line export can be re-run. Anything else there is kept.
            if out.exists() and is_export_dir(out):
                overwrite = True
        path = export_checkpoint(
            opts["checkpoint"],
            out,
            dtype=dtype,
            fmt=opts["format"],
            tokenizer=opts["tokenizer"],
            overwrite=overwrite,
            verify=opts["verify"],
        )
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        print(f"{PROG}: wrote {path} ({opts['format']} format, {opts['dtype']}, {size:.1f} MB)")
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    # Run the imported module's main, not this `__main__` copy: lmsys.hf and lmsys.generate raise
    # lmsys.export.ExportError, which must be the class run_cli catches.
    from lmsys.export import main as _main

    sys.exit(_main())
