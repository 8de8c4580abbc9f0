"""Typed configuration: the dataclass schema Hydra composes into, validation, derived values.

Configuration is composed once (`compose` or a Hydra entry point), validated once (`validate`),
and handed down as plain dataclass objects. Nothing below this module reads the global config.

Every YAML file in conf/ only sets values; the schema lives here, registered with Hydra's
ConfigStore as `lmsys_schema`, so a misspelled key or a wrongly typed value fails at
composition. Value checks that types cannot express (heads dividing the width, known
activation names, ...) live in `validate`, which raises `ConfigError` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

from lmsys.core.choices import COMPILE_CHOICES, text_encoding
from lmsys.core.errors import ConfigError

# The model's schema, widths and validation live in model_config.py; imported from here by the rest.
from lmsys.core.model_config import (  # noqa: F401
    ACTIVATIONS,
    BLOCK_KINDS,
    HF_MODEL_TYPES,
    KERNEL_CHOICES,
    LOSS_IMPLS,
    NORM_FORMULAS,
    POSITION_KINDS,
    ROPE_SCALINGS,
    SOFTMAX_KINDS,
    AttentionConfig,
    FFNConfig,
    ModelConfig,
    ModelDims,
    NormConfig,
    PositionsConfig,
    RopeScalingConfig,
    autoregressive,
    context_prefix,
    divisors,
    either,
    model_dims,
    one_of,
    require,
    tokenizer_size,
    tokens_per_sample,
    validate_model,
    validate_sequence_parallel,
)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/
ROOT_CONFIG = CONF_DIR / "config.yaml"  # its root config: the schema, the groups' defaults, Hydra's settings

OPTIMIZERS = ("adamw", "muon")
DATA_FORMATS = ("text", "chat")
SCHEDULES = ("cosine", "wsd")


def compile_choice(value: object) -> str:
    """trainer.compile as one of COMPILE_CHOICES' spellings (Hydra turns `true` into a bool)."""
    return str(value).lower()


# ----------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    # Inputs for lmsys-prepare: files, directories or globs of .txt/.md/.jsonl(.gz). Empty means
    # the default corpus (documentation text of the Python standard library on this machine).
    sources: list[str] = field(default_factory=list)
    dir: str = "data/default"  # prepared tokenizer.model + shards + manifest.json
    tokenizer: str | None = None  # reuse this tokenizer.model instead of training one
    vocab_size: int = "${model.vocab_size}"  # type: ignore[assignment]  # one source of truth
    text_field: str = "text"  # .jsonl field holding the document text
    val_fraction: float = 0.05
    tokenizer_sample_bytes: int = 20_000_000  # train the tokenizer on a bounded random sample
    on_decode_error: str = "error"  # error | skip: undecodable bytes
    encoding: str = "utf-8"  # of the text files (a .jsonl is UTF-8): latin-1, cp1252, utf-16, ...
    # In a directory (or a glob naming no suffix), read exactly the files of these suffixes, e.g.
    # [.py,.pyi] for a code corpus; empty: .txt, .md, .jsonl and text of no known type.
    suffixes: list[str] = field(default_factory=list)
    num_workers: int = 0  # 0 means all cores
    shard_tokens: int = 50_000_000
    seq_len: int = "${model.max_seq_len}"  # type: ignore[assignment]
    mask_doc_boundaries: bool = False  # zero loss weight on predictions across an eos boundary
    # Each packed document its own sequence: attention within it, positions from its first token,
    # no loss across two (docs/data.md, "Packed documents")
    document_masking: bool = False
    # lmsys-prepare: text (documents) | chat (JSON Lines of conversations, rendered with the
    # tokenizer's chat template, loss on the assistant's turns: docs/data.md, "Chat data")
    format: str = "text"
    packing: bool = True  # chat: several conversations per row of data.seq_len (false: one, padded)
    overlong: str = "truncate"  # chat: a conversation longer than a row (seq_len + 1): truncate | drop
    chat_template: str | None = None  # chat: a Jinja template file instead of the tokenizer's own
    seed: int = 1234
    overwrite: bool = False  # lmsys-prepare: re-prepare even when data.dir already matches the sources


# ----------------------------------------------------------------------------- optimisation


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float = 6e-4  # AdamW's peak lr (under muon: embeddings, unembedding, norms, biases)
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | wsd (warmup, stable at lr, linear decay over decay_frac)
    decay_frac: float = 0.2  # wsd: the share of the schedule's steps spent decaying
    muon_lr: float = 0.02  # optim=muon: peak lr of the hidden matrices (follows lr's schedule)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0  # decoupled, like AdamW's: w *= 1 - lr * wd
    # The step at which the cosine reaches its floor; 0: trainer.max_steps of the run's first launch.
    # A resumed run with a higher trainer.max_steps keeps its schedule (the lr stays at the floor
    # after it) unless this is set: e.g. optim.decay_steps=<new max_steps> stretches the cosine.
    decay_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class DeepSpeedConfig:
    stage: int = 2  # ZeRO stage 0..3
    offload_optimizer: bool = False
    offload_param: bool = False
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    activation_checkpointing: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    # ZeRO-3 keeps parameters smaller than this (elements) whole on every rank (DeepSpeed's
    # stage3_param_persistence_threshold); 0 partitions every parameter.
    param_persistence_threshold: int = 100_000


@dataclass
class LoggerConfig:
    wandb: str = "offline"  # online | offline | disabled; online needs WANDB_API_KEY in the environment
    project: str = "lmsys"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    log_interval: int = 10  # steps between W&B records (metrics.jsonl gets every step)
    # steps between plain progress lines when the console is not a terminal (a log file, a pipe,
    # SLURM) or trainer.progress=false; a terminal shows the progress bar instead
    console_interval: int = 10
    # rank 0 draws <run_dir>/loss.png when the run ends (matplotlib: about a second of CPU); false
    # skips it (thousands of short sweep jobs, CI); metrics.jsonl holds the same numbers
    plot: bool = True


@dataclass
class TrainerConfig:
    run_dir: str | None = None  # None: runs/<model.name>-<timestamp>, shared by every rank
    seed: int = 1337
    max_steps: int = 1000
    global_batch_tokens: int = 65536  # tokens per optimizer step across all ranks
    micro_batch_size: int = 8  # sequences per rank per forward
    eval_interval: int = 200
    eval_batches: int = 0  # N: the first N x micro_batch_size validation sequences; 0: the whole split
    save_interval: int = 500  # also saved at the end, and after the step under way on SIGTERM/SIGUSR1/Ctrl-C
    keep_last: int = 3  # complete, intact checkpoints kept (damaged ones are moved to checkpoints/damaged/)
    # save in the background: the loop stalls only to copy the state to host memory; a checkpoint
    # is committed once every rank's files are written (docs/checkpoints.md); false: synchronous
    async_save: bool = True
    # auto | never | <checkpoint dir or run dir: its newest intact checkpoint>; on any world size and
    # ZeRO stage that splits the global batch
    resume: str = "auto"
    max_nan_skips: int = 5  # steps skipped (or rewound) for a non-finite or diverging loss, then stop
    # A step whose loss or gradient norm is non-finite, or whose loss diverges, is reported
    # (<run>/diagnostics/, docs/debugging.md), then: skip (its update) | stop (exit 1) | rewind (to the
    # last intact checkpoint, never training on that step's data again)
    on_nonfinite: str = "skip"
    spike_factor: float = 2.0  # diverging: loss above this times its running median (0: off)
    spike_margin: float = 1.0  # diverging: loss above log(vocab_size) + this many nats (0: off)
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True
    # torch.compile the model: auto (on CUDA; eager elsewhere, and eager if compiling fails), true
    # (a failure is an error), false (eager)
    compile: str = "auto"
    dist_timeout_s: float = 600.0  # collective timeout: a dead or hung rank brings the job down
    # No progress for this long on a rank: the watchdog names the ranks that did not arrive, writes
    # every rank's stacks to <run>/diagnostics and ends the job (exit 86); 0 turns it off
    hang_timeout_s: float = 300.0
    # Bitwise-reproducible runs: torch's deterministic algorithms (an op without one is an error),
    # CUBLAS_WORKSPACE_CONFIG, fixed Triton tilings (docs/debugging.md: what it costs)
    deterministic: bool = False
    # The memory plan before the engine is built (lmsys-plan's prediction): auto (refuse on CUDA,
    # warn on CPU) | refuse (a launch predicted not to fit stops, with what would fit) | warn | off
    plan: str = "auto"
    plan_memory_bytes: int = 0  # memory per rank the plan compares with; 0: the device's own
    # Ulysses sequence parallelism: groups of this many ranks each hold data.seq_len / it positions of
    # every sequence, attention gathers the sequence for model.n_heads / it heads (docs/training.md)
    sequence_parallel: int = 1


@dataclass
class DebugConfig:
    """Fault injection for tests (lmsys/training/faults.py): the defaults inject nothing, leave them
    in real runs."""

    nan_steps: list[int] = field(default_factory=list)  # the loss is NaN at these steps
    step_delay_s: float = 0.0  # every step sleeps this long after it
    crash_at_step: int = 0  # the last rank exits at this step, on a first attempt
    signal_at_step: int = 0  # the last rank sends itself SIGTERM (a preemption that reaches one rank)
    # every checkpoint save sleeps this long with its files written, before it is committed (in the
    # background writer under trainer.async_save)
    save_delay_s: float = 0.0
    # "MODULE:PASS:rankR:stepS[:microM]", PASS forward | backward | weights: a NaN in that module's
    # output, its input gradient, or (after the step) its weights
    nonfinite_at: list[str] = field(default_factory=list)
    hang_step: int = 0  # the last rank hangs at the start of this step ...
    hang_how: str = "sleep"  # ... asleep, or frozen with SIGSTOP ("stop")
    break_kernel: str = ""  # the kernel self-check sees this kernel's output perturbed
    # "WHERE:rankR:stepS", WHERE copy | replay: the diagnosis of bad step S runs out of memory on
    # rank R, allocating its copy of the model or in its replay
    replay_oom: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    """Register the schema so conf/config.yaml can start its defaults list with `lmsys_schema`."""
    ConfigStore.instance().store(name="lmsys_schema", node=Config)


register_configs()


# ----------------------------------------------------------------------------- validation


NONFINITE_POLICIES = ("skip", "stop", "rewind")  # trainer.on_nonfinite
NONFINITE_INJECTION = re.compile(r"[\w.]+:(forward|backward|weights):rank\d+:step\d+(:micro\d+)?")
REPLAY_OOM_INJECTION = re.compile(r"(copy|replay):rank\d+:step\d+")


def _specs(key: str, specs: list[str], pattern: re.Pattern[str], form: str) -> None:
    for spec in specs:
        require(pattern.fullmatch(str(spec)) is not None, f"{key}: {spec!r} is not {form}")


def validate_data(d: DataConfig, model: ModelConfig) -> None:
    """The data group's values (ConfigError naming the first bad one)."""
    require(d.vocab_size == model.vocab_size, f"data.vocab_size={d.vocab_size} must equal model.vocab_size")
    require(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    if model.positions.kind != "none":
        require(
            d.seq_len <= model.max_seq_len,
            f"data.seq_len={d.seq_len} is longer than the model's positions "
            f"(model.max_seq_len={model.max_seq_len})",
        )
    require(0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    one_of("data.on_decode_error", d.on_decode_error, ("error", "skip"))
    one_of("data.format", d.format, DATA_FORMATS)
    one_of("data.overlong", d.overlong, ("truncate", "drop"))
    require(
        text_encoding(d.encoding) is not None,
        f"data.encoding={d.encoding!r} is not a text encoding Python knows; e.g. utf-8, latin-1, cp1252",
    )
    require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0 (0 means all cores)")
    require(d.shard_tokens >= 1, f"data.shard_tokens={d.shard_tokens} must be >= 1")
    require(
        d.tokenizer_sample_bytes >= 1, f"data.tokenizer_sample_bytes={d.tokenizer_sample_bytes} must be >= 1"
    )
    require(bool(d.text_field), "data.text_field must not be empty")
    require(bool(d.dir), "data.dir must not be empty")


def validate(cfg: Config) -> Config:
    validate_model(cfg.model)
    validate_data(cfg.data, cfg.model)
    t, o, ds, lg = cfg.trainer, cfg.optim, cfg.deepspeed, cfg.logger
    require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    one_of("optim.name", o.name, OPTIMIZERS)
    one_of("optim.schedule", o.schedule, SCHEDULES)
    require(0 < o.decay_frac <= 1, f"optim.decay_frac={o.decay_frac} must be in (0, 1]")
    require(o.muon_lr > 0, f"optim.muon_lr={o.muon_lr} must be > 0")
    require(0 <= o.muon_momentum < 1, f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
    require(o.muon_weight_decay >= 0, f"optim.muon_weight_decay={o.muon_weight_decay} must be >= 0")
    if o.name == "muon":
        # DeepSpeed's ZeRO 1-2 put the orthogonalized update where the gradient was before
        # clipping, so a clip there would scale Muon's step, not the gradient (unlike at ZeRO 0).
        require(
            o.grad_clip == 0,
            f"optim=muon needs optim.grad_clip=0 (got {o.grad_clip}): Muon's step is orthogonalized, its "
            "size set by optim.muon_lr, and DeepSpeed would clip the update rather than the gradient",
        )
    require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    require(o.decay_steps >= 0, f"optim.decay_steps={o.decay_steps} must be >= 0 (0: trainer.max_steps)")
    require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    require(ds.stage in (0, 1, 2, 3), f"deepspeed.stage={ds.stage} is not valid; choose one of: 0, 1, 2, 3")
    one_of("deepspeed.precision", ds.precision, ("auto", "fp32", "bf16", "fp16"))
    one_of("logger.wandb", lg.wandb, ("online", "offline", "disabled"))
    require(lg.log_interval >= 1, f"logger.log_interval={lg.log_interval} must be >= 1")
    require(lg.console_interval >= 1, f"logger.console_interval={lg.console_interval} must be >= 1")
    require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size} must be >= 1")
    require(t.global_batch_tokens >= 1, f"trainer.global_batch_tokens={t.global_batch_tokens} must be >= 1")
    require(t.keep_last >= 1, f"trainer.keep_last={t.keep_last} must be >= 1")
    require(t.eval_interval >= 1, f"trainer.eval_interval={t.eval_interval} must be >= 1")
    require(
        t.eval_batches >= 0,
        f"trainer.eval_batches={t.eval_batches} must be >= 0 (0: the whole validation split)",
    )
    require(t.save_interval >= 1, f"trainer.save_interval={t.save_interval} must be >= 1")
    require(t.max_nan_skips >= 0, f"trainer.max_nan_skips={t.max_nan_skips} must be >= 0")
    one_of("trainer.on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    require(
        t.spike_factor == 0 or t.spike_factor > 1,
        f"trainer.spike_factor={t.spike_factor} must be > 1 (0: off)",
    )
    require(t.spike_margin >= 0, f"trainer.spike_margin={t.spike_margin} must be >= 0 (0: off)")
    _specs("debug.nonfinite_at", cfg.debug.nonfinite_at, NONFINITE_INJECTION,
           "MODULE:PASS:rankR:stepS[:microM] with PASS forward, backward or weights "
           "(e.g. blocks.1.attn:backward:rank1:step4)")  # fmt: skip
    _specs("debug.replay_oom", cfg.debug.replay_oom, REPLAY_OOM_INJECTION,
           "WHERE:rankR:stepS with WHERE copy or replay (e.g. copy:rank1:step3)")  # fmt: skip
    require(t.dist_timeout_s > 0, f"trainer.dist_timeout_s={t.dist_timeout_s} must be > 0")
    require(
        t.hang_timeout_s == 0 or 0 < t.hang_timeout_s < t.dist_timeout_s,
        f"trainer.hang_timeout_s={t.hang_timeout_s:g} must be below trainer.dist_timeout_s="
        f"{t.dist_timeout_s:g} (the watchdog names a stuck rank before the collective timeout ends the "
        "job), or 0 (off)",
    )
    one_of("debug.hang_how", cfg.debug.hang_how, ("sleep", "stop"))
    kernel_names = (
        "", "attention", "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "rotary", "gated",
        "linear_cross_entropy",
    )  # fmt: skip
    one_of("debug.break_kernel", cfg.debug.break_kernel, kernel_names)
    require(
        compile_choice(t.compile) in COMPILE_CHOICES,
        f"trainer.compile={t.compile} is not valid; choose one of: {', '.join(COMPILE_CHOICES)}",
    )
    require(bool(t.resume), "trainer.resume must be auto, never or a checkpoint directory")
    require(
        ds.param_persistence_threshold >= 0,
        f"deepspeed.param_persistence_threshold={ds.param_persistence_threshold} must be >= 0",
    )
    if ds.offload_param:
        require(ds.stage == 3, f"deepspeed.offload_param=true needs deepspeed.stage=3 (got {ds.stage})")
    if ds.offload_optimizer:
        require(ds.stage >= 1, "deepspeed.offload_optimizer=true needs deepspeed.stage >= 1 (got 0)")
    one_of("trainer.device", t.device, ("auto", "cpu", "cuda"))
    one_of("trainer.plan", t.plan, ("auto", "refuse", "warn", "off"))
    validate_sequence_parallel(t.sequence_parallel, cfg.model, cfg.data.seq_len)
    require(t.plan_memory_bytes >= 0, f"trainer.plan_memory_bytes={t.plan_memory_bytes} must be >= 0")
    return cfg


# ----------------------------------------------------------------------------- composition


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed DictConfig (Hydra's, possibly with a `hydra` node) into a validated Config."""
    if isinstance(cfg, Config):
        return validate(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    structured = OmegaConf.merge(OmegaConf.structured(Config), container)
    obj = OmegaConf.to_object(structured)
    assert isinstance(obj, Config)
    return validate(obj)


def hydra_error_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors carry several lines and a chain of causes; keep one line that
    names the key (the first message with a `full_key:`), plus the valid options when listed and,
    for a misspelled key or group choice, the nearest valid one."""
    chain: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 10:
        if str(seen).strip():
            chain.append(str(seen).strip())
        seen = seen.__cause__ or seen.__context__
    if not chain:
        return type(exc).__name__
    text = next((m for m in chain if "full_key:" in m), chain[0])
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    if full_key and full_key not in head:
        head = f"{head} (key: {full_key})"
    if "Available options" in text:
        options = text.split("Available options", 1)[1].split("Config search path", 1)[0]
        names = [ln.strip() for ln in options.splitlines()[1:] if ln.strip()]
        head = f"{head}; available: {', '.join(names)}"
        missing = re.search(r"Could not find '([^/']+)/([^']+)'", head)
        if missing:
            head += _did_you_mean(missing.group(2), names, f"{missing.group(1)}=")
    unknown = re.match(r"Key '([^']+)' not in '(\w+)'", head)
    if unknown:
        parent = full_key.rpartition(".")[0] if full_key else ""
        prefix = f"{parent}." if parent else ""
        moved = moved_key(f"{prefix}{unknown.group(1)}")
        if moved is not None:
            return moved
        head += _did_you_mean(unknown.group(1), schema_keys(parent), prefix)
    return head


def moved_key(key: str) -> str | None:
    """For a key of the fault-injection group spelled under trainer (trainer.debug_nan_steps), the
    line naming its key (debug.nan_steps); None for any other key."""
    name = key.removeprefix("trainer.debug_")
    if name != key and name in schema_keys("debug"):
        return f"{key} is now debug.{name}"
    return None


def _did_you_mean(word: str, valid: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def bracket_list_value(override: str) -> str:
    """`data.sources=corpus/` -> `data.sources=[corpus/]`: a bare value for a list key is a list of
    one (OmegaConf would refuse it with a type error that names no fix)."""
    key, sep, value = override.partition("=")
    if not sep or not value or value.startswith("[") or value in ("null", "None") or key[:1] in "+~":
        return override
    parent, _, name = key.rpartition(".")
    node: Any = Config
    for part in [p for p in parent.split(".") if p]:
        node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
    hint = typing.get_type_hints(node).get(name) if dataclasses.is_dataclass(node) else None
    return f"{key}=[{value}]" if typing.get_origin(hint) is list else override


def schema_keys(path: str = "") -> list[str]:
    """The keys the schema allows under a dotted path ("" for the top level, e.g. "model.ffn")."""
    node: Any = Config
    for part in [p for p in path.split(".") if p]:
        hints = typing.get_type_hints(node)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return []
        node = hints[part]
    return [f.name for f in dataclasses.fields(node)]


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Config:
    """Compose conf/<config_name>.yaml with Hydra overrides and return the validated Config.

    The public entry point used by every CLI and by outside checks. Raises ConfigError with one
    line naming the key for a misspelled key, a wrong type, or an invalid value.
    """
    for override in overrides or []:
        moved = moved_key(override.lstrip("+~").partition("=")[0])
        if moved is not None:
            raise ConfigError(moved)
    overrides = adopt_init_from([bracket_list_value(o) for o in overrides or []])
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name=config_name, overrides=overrides)
        return to_config(composed)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra/OmegaConf raise many types; the user needs one line
        bare = [o for o in overrides if "=" not in o and not o.startswith("~")]
        hint = " (overrides are key=value, e.g. model=seed_trax or data.dir=data/mine)" if bare else ""
        raise ConfigError(hydra_error_line(exc) + hint) from exc


INIT_FROM_PRESET = "init_from"  # the model group's choice that model.init_from=DIR alone registers


def adopt_init_from(overrides: list[str]) -> list[str]:
    """`model.init_from=DIR` without a `model=` preset: the model DIR's export records becomes the
    run's preset (registered in Hydra's ConfigStore as `model=init_from`), the command line's other
    `model.*` keys apply on top, and `data.vocab_size` / `data.seq_len` follow it as they follow any
    preset. Overrides are returned unchanged when a preset is named, when DIR records no model
    (then model.init_from's own checks say what is wrong) or when init_from is swept (a, b)."""
    presets = [o for o in overrides if o.partition("=")[0].lstrip("+") == "model"]
    if any(o.partition("=")[2] != INIT_FROM_PRESET for o in presets):
        return overrides
    rest = [o for o in overrides if o not in presets]
    given = [o.partition("=")[2] for o in rest if o.partition("=")[0].lstrip("+") == "model.init_from"]
    value = given[-1].strip("'\"") if given else ""
    if not value or value in ("null", "None") or "," in value:
        return rest
    recorded = export_model_config(Path(value).expanduser())
    if recorded is None:
        return rest
    ConfigStore.instance().store(group="model", name=INIT_FROM_PRESET, node=recorded)
    return [*rest, f"model={INIT_FROM_PRESET}"]  # last: Hydra's flags (-m) may lead


def export_model_config(directory: Path) -> dict[str, Any] | None:
    """The model config an export directory records: its config.json (lmsys format), or the one a
    format=hf export keeps in its safetensors header; None when there is none (not an export)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "model_type" in config:  # a transformers config.json: lmsys's own is in the weights' header
        try:
            with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
                config = json.loads((f.metadata() or {}).get("lmsys_model_config", "null"))
        except Exception:  # no weights, or not a safetensors file: nothing recorded
            return None
    if not isinstance(config, dict) or "d_model" not in config:
        return None
    config.pop("init_from", None)
    return config


def config_groups() -> dict[str, tuple[list[str], str | None]]:
    """Each config group of conf/ -> (its choices, the default conf/config.yaml picks)."""
    defaults: dict[str, str] = {}
    for entry in OmegaConf.load(ROOT_CONFIG).get("defaults", []):
        if isinstance(entry, (DictConfig, dict)):
            for key, value in dict(entry).items():
                if not str(key).startswith("override"):
                    defaults[str(key)] = str(value)
    groups = {}
    for directory in sorted(p for p in CONF_DIR.rglob("*") if p.is_dir()):
        choices = sorted(f.stem for f in directory.glob("*.yaml"))
        if choices:
            group = directory.relative_to(CONF_DIR).as_posix()
            groups[group] = (choices, defaults.get(group))
    return groups


def compose_model(preset: str, overrides: list[str] | None = None) -> ModelConfig:
    """The ModelConfig of a conf/model preset with model-relative overrides, e.g. ["d_model=32"]."""
    return compose([f"model={preset}", *[f"model.{o}" for o in (overrides or [])]]).model


def flatten_dict(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys: {"model": {"d_model": 8}} -> {"model.d_model": 8}."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten_dict(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_to_dict(cfg: Config) -> dict[str, Any]:
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(container, dict)
    return container


def config_keys() -> list[str]:
    """Every dotted key of the default config (model.d_model, trainer.max_steps, ...): what a
    command's overrides may set."""
    return list(flatten_dict(config_to_dict(compose([]))))


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Rebuild a validated ModelConfig from its dict form (config.json of an export, a checkpoint)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), data)
        obj = OmegaConf.to_object(merged)
    except Exception as exc:
        raise ConfigError(hydra_error_line(exc)) from exc
    assert isinstance(obj, ModelConfig)
    validate_model(obj)
    return obj
