"""`lmsys-train --help`: lmsys's own help (Hydra's would be a config dump), with the config
groups, the most used keys and their current values, and examples."""

from __future__ import annotations

from lmsys.core.config import compose, config_groups, config_to_dict, flatten_dict

# The keys most runs set, with one line each (every key: lmsys/core/config.py and conf/).
KEY_HELP = [
    ("trainer.max_steps", "optimizer steps to train"),
    ("trainer.global_batch_tokens", "tokens per optimizer step over all ranks (accumulation is derived)"),
    ("trainer.micro_batch_size", "sequences per rank per forward"),
    ("trainer.run_dir", "the run's directory (null: runs/<model.name>-<time>)"),
    ("trainer.resume", "auto | never | a checkpoint or run directory to continue from"),
    ("trainer.eval_interval", "steps between validations"),
    ("trainer.eval_batches", "validation sequences: N x micro_batch_size, any world size (0: all)"),
    ("trainer.save_interval", "steps between checkpoints"),
    ("trainer.keep_last", "checkpoints kept"),
    ("trainer.async_save", "save in the background (false: the loop waits for the whole save)"),
    ("trainer.device", "auto | cpu | cuda"),
    ("trainer.on_nonfinite", "a NaN/inf or diverging step, once reported: skip | stop | rewind"),
    ("optim.name", "adamw | muon (optim=muon: Muon on the blocks' matrices, AdamW on the rest)"),
    ("optim.lr", "peak learning rate (linear warmup, then cosine or wsd decay)"),
    ("optim.schedule", "cosine | wsd (warmup-stable-decay: flat, then linear over optim.decay_frac)"),
    (
        "trainer.plan",
        "memory plan before the engine: auto (refuse on CUDA, warn on CPU) | refuse | warn | off",
    ),
    ("optim.warmup_steps", "steps of linear warmup"),
    ("optim.decay_steps", "where the decay ends (0: max_steps of the run's first launch)"),
    ("data.dir", "prepared data (lmsys-prepare writes it)"),
    ("data.seq_len", "positions per training sequence"),
    ("deepspeed.stage", "ZeRO stage: 0 (replicated) to 3 (parameters sharded)"),
    ("deepspeed.precision", "auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16"),
    ("model.kernels", "auto (Triton on CUDA) | triton | torch"),
    ("trainer.compile", "torch.compile the model: auto (on CUDA) | true | false"),
    ("logger.wandb", "offline | online (needs WANDB_API_KEY) | disabled"),
    ("logger.console_interval", "steps between progress lines in a log file (no terminal)"),
    ("logger.plot", "draw <run_dir>/loss.png when the run ends (false: skip matplotlib)"),
    ("trainer.progress", "the progress bar in a terminal (false: progress lines instead)"),
    ("trainer.deterministic", "bitwise-equal reruns (deterministic torch ops, fixed kernel tilings)"),
    ("trainer.hang_timeout_s", "no progress this long: name the stuck ranks, end the job, exit 86 (0: off)"),
]

EXAMPLES = """\
examples: each runs as written on the default data (data/default)
  python -m lmsys.prepare                                          # once: data/default
  python -m lmsys.train trainer.max_steps=50                       # one process
  python -m launch.torchrun -- deepspeed=zero3 trainer.max_steps=50   # 2 processes (1 per GPU)
  python -m launch.torchrun --nproc 8 -- model=gpt2_124m model.vocab_size=2048 trainer=gpt2 optim=gpt2
  lmsys-train -m optim.lr=1e-3,3e-4 trainer.max_steps=50           # a sweep: one job each
  lmsys-train --cfg job model=gpt2_124m                            # print the composed config"""


def usage(prog: str, doc: str, overrides: list[str]) -> str:
    """lmsys-train --help: what it does (the first paragraph of `doc`), the config groups, the
    most used keys and their values under `overrides` (`lmsys-train model=gpt2_124m --help` shows
    that preset's)."""
    defaults = flatten_dict(config_to_dict(compose(overrides)))
    lines = [
        f"usage: {prog} [group=choice ...] [key=value ...]     (or -m ... for a sweep)",
        "",
        doc.split("\n\n")[0].strip(),
        "",
        "config groups (group=choice; * marks the default):",
    ]
    for group, (choices, default) in config_groups().items():
        marked = ", ".join(f"{c}*" if c == default else c for c in choices)
        lines.append(f"  {group:<16}{marked}")
    lines += ["", "most used keys (key=value; the value it has now in brackets):"]
    for key, text in KEY_HELP:
        value = defaults.get(key)
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"  {key:<30}{text} [{shown}]")
    lines += [
        "",
        EXAMPLES,
        "",
        "Hydra's own flags: --cfg job, --info, --hydra-help. A mistake is one line on stderr, exit 2.",
    ]
    return "\n".join(lines)
