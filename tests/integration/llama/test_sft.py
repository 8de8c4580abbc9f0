"""docs/huggingface.md's supervised fine-tuning journey, "Fine-tune Qwen3-0.6B on conversations",
run command by command on a tiny stand-in, and what it must give:

- every command of the journey's bash block runs as written, but for the values STAND_IN changes
  (each with why): a random Qwen3 (QK-norm, multi-query attention, a padded vocabulary) whose
  tokenizer has ChatML's control tokens and a Qwen3-like chat template (an empty think block
  opening the last reply) stands in for Qwen's download, conversations "What is item i?" ->
  "Item i is number j." for the user's file, 1 CPU process for 8 GPUs (2 ranks with document
  masking: tests/integration/training/test_document_masking.py), 60 steps;
- the import keeps the chat template; the preview shows the replies trained and writes nothing;
- the fine-tuned model's loss on the held-out conversations' assistant tokens is below the
  imported model's, and the run's validation loss falls;
- `lmsys-generate chat=true` answers in the template: "Item N is number M." after the think
  block, ending at <|im_end|>; transformers' own generate on the export, from
  `apply_chat_template(..., add_generation_prompt=True)`, gives the same tokens."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.exports import REPO_ROOT, child_env
from tests.hf_files import (
    IM_END,
    random_family_model,
    save_chat_tokenizer,
    thinking_template,
    train_chat_tokenizer,
)
from tests.stdlib_text import module_docstrings

pytestmark = pytest.mark.slow

DOC = REPO_ROOT / "docs" / "huggingface.md"
SECTION = "## Fine-tune Qwen3-0.6B on conversations (supervised fine-tuning)"
PIECES = 384  # the byte-level BPE's pieces before the chat control tokens
CONTEXT = 128
STEPS = 60
PROMPT = "What is item 5?"
# The journey's text -> (what runs instead, why). Anything not named here runs as written.
STAND_IN = {
    "torchrun --nproc_per_node=8 -m lmsys.train": (f"{sys.executable} -m lmsys.train",
                                                   "1 CPU process for 8 GPUs (2: test_document_masking.py)"),
    "data.seq_len=4096": (f"data.seq_len={CONTEXT}", f"the stand-in's context is {CONTEXT} positions"),
    "trainer.global_batch_tokens=262144": (f"trainer.global_batch_tokens={8 * CONTEXT}",
                                           "8 rows: micro-batch 4 x accumulation 2"),
    "trainer.max_steps=500": (f"trainer.max_steps={STEPS}", "seconds, not hours"),
    "trainer.eval_interval=100": ("trainer.eval_interval=20", "three evaluations in 60 steps"),
    "optim.lr=1e-5": ("optim.lr=3e-3", "a random model: steps large enough to learn the replies' form"),
    "optim.warmup_steps=20": ("optim.warmup_steps=5", "60 steps in all"),
    'prompt="What does the json module do?"': (f'prompt="{PROMPT}"', "a question of the stand-in's kind"),
    "max_new_tokens=200": ("max_new_tokens=40 output=jsonl",
                           "the stand-in's window; the test reads how many tokens came (the stop)"),
}  # fmt: skip
NOT_RUN = {
    "hf download ": "a download: the random Qwen3 stands in at hf/Qwen3-0.6B",
    "lm_eval ": "its tasks are downloads; tests/integration/llama/test_fine_tune.py runs lm_eval on an "
    "export",
}


def journey_commands() -> list[str]:
    text = DOC.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.join(shlex.split(line, comments=True)) for line in block.splitlines() if line.strip()]


def stand_in(command: str) -> list[str]:
    for text, (replacement, _) in STAND_IN.items():
        command = command.replace(shlex.join(shlex.split(text)), replacement)
    words = shlex.split(command)
    scripts = {"lmsys-import": "lmsys.hf_import", "lmsys-prepare": "lmsys.prepare",
               "lmsys-export": "lmsys.export", "lmsys-generate": "lmsys.generate"}  # fmt: skip
    return [sys.executable, "-m", scripts[words[0]], *words[1:]] if words[0] in scripts else words


def write_conversations(path: Path, n: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            reply = f"Item {i} is number {i * 7 % 13}."
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is item {i}?"},
                                             {"role": "assistant", "content": reply}]}) + "\n")  # fmt: skip


@pytest.fixture(scope="module")
def journey(tmp_path_factory, transformers) -> tuple[Path, dict[str, str]]:
    """The user's directory after the journey, and each command's output."""
    cwd = tmp_path_factory.mktemp("sft_journey")
    texts = [
        doc for name in ("json", "argparse", "collections", "textwrap") for doc in module_docstrings(name)
    ]
    tokenizer = train_chat_tokenizer(texts, PIECES)
    im_end = tokenizer.token_to_id(IM_END)
    hf = cwd / "hf" / "Qwen3-0.6B"
    model = random_family_model("qwen3", tokenizer.get_vocab_size(), im_end, n_positions=CONTEXT)
    model.save_pretrained(hf)
    save_chat_tokenizer(hf, tokenizer, thinking_template())
    write_conversations(cwd / "chats.jsonl", 240)
    outputs = {}
    for command in journey_commands():
        if any(command.startswith(k) for k in NOT_RUN):
            continue
        proc = subprocess.run(stand_in(command), cwd=cwd, env=child_env(), capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{command}\n{proc.stderr[-4000:]}"
        outputs[command] = proc.stdout
    return cwd, outputs


def output(outputs: dict[str, str], part: str) -> str:
    """The output of the one command that holds `part`."""
    (key,) = [k for k in outputs if part in k]
    return outputs[key]


def test_every_command_runs_and_the_preview_shows_the_replies(journey):
    cwd, outputs = journey
    commands = journey_commands()
    assert len(commands) == 8 and len(outputs) == 6
    for text in STAND_IN:  # every stand-in still names a documented value
        assert any(shlex.join(shlex.split(text)) in c for c in commands), (
            f"the journey no longer has {text!r}"
        )
    preview = output(outputs, "preview=2")
    assert "<|im_start|>assistant\n[[<think>\n\n</think>\n\nItem 0 is number 0.<|im_end|>]]" in preview
    template = json.loads((cwd / "exports" / "qwen3-0.6b" / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    assert template == thinking_template()  # the import kept it


def held_out_loss(model, data_dir: Path) -> float:
    """The loss on the assistant tokens of every held-out conversation (the val split)."""
    from lmsys.data.loader import TokenLoader
    from lmsys.data.shards import PreparedData
    from lmsys.model.transformer import next_token_pairs

    loader = TokenLoader(PreparedData(data_dir), "val", tokens_per_sample=CONTEXT + 1, global_batch_size=1,
                         micro_batch_size=1, document_masking=True)  # fmt: skip
    total = weight = 0.0
    with torch.no_grad():
        for batch in loader.val_batches(0):
            _, _, pairs = next_token_pairs(model.cfg, batch.tokens, batch.weights, batch.documents)
            total += model.loss(batch.tokens, batch.weights, batch.documents).item() * pairs.sum().item()
            weight += pairs.sum().item()
    return total / weight


def test_fine_tuning_lowers_the_held_out_loss_of_the_replies(journey):
    from lmsys.core.rundir import read_metrics
    from lmsys.interop.export_dir import load_export

    cwd, _ = journey
    before = held_out_loss(load_export(cwd / "exports" / "qwen3-0.6b")[0], cwd / "data" / "qwen3-chat")
    after = held_out_loss(load_export(cwd / "exports" / "qwen3-sft-hf")[0], cwd / "data" / "qwen3-chat")
    assert after < before - 1.0, (before, after)
    evals = [r["loss"] for r in read_metrics(cwd / "runs" / "qwen3-sft", "eval")]
    assert len(evals) == 3 and evals[-1] < evals[0], evals
    assert evals[-1] == pytest.approx(after, rel=1e-3)  # the run's validation loss is that loss


def test_the_model_answers_in_its_template(journey, transformers):
    cwd, outputs = journey
    reply = json.loads(output(outputs, "lmsys-generate ").splitlines()[-1])
    assert re.fullmatch(r"<think>\n\n</think>\n\nItem \d+ is number \d+\.", reply["completion"]), reply
    assert reply["new_tokens"] < 40  # it stopped at the end of its turn
    export = cwd / "exports" / "qwen3-sft-hf"
    auto = transformers.AutoTokenizer.from_pretrained(export)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    ids = auto.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   return_dict=True, return_tensors="pt")["input_ids"]  # fmt: skip
    out = hf.generate(
        ids, max_new_tokens=40, do_sample=False, eos_token_id=auto.convert_tokens_to_ids(IM_END)
    )
    new = out[0, ids.shape[1] :].tolist()
    assert new[-1] == auto.convert_tokens_to_ids(IM_END) and len(new) == reply["new_tokens"] + 1
    assert auto.decode(new[:-1]) == reply["completion"]
