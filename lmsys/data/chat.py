"""Conversations: reading them from JSON Lines, rendering them with the tokenizer's chat template,
and which tokens are trained (the assistant's), for lmsys-prepare data.format=chat and
lmsys-generate chat=true.

A line holds one conversation, in either common form:
- `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`;
- `{"prompt": ..., "completion": ...}`: a string each (a user turn, then an assistant turn), or
  lists of messages (the prompt's, then the completion's).
Other keys are ignored. A line that is not such an object (invalid JSON, a message without a role
or with another role, content that is not a string, no message at all, no assistant message) is
a `BadConversation` naming what is wrong; lmsys-prepare counts and names them by line number.

Rendering is transformers' `apply_chat_template`: the template (data.chat_template's file when
given, else `chat_template.jinja` beside the tokenizer, else `chat_template` in its
tokenizer_config.json, else `default_chat_template`) runs in Jinja's immutable sandbox with the
settings and helpers transformers gives it (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`, the `{% generation %}` tag, the special tokens as
`bos_token`, `eos_token`, ...), and the text is encoded with its control tokens read as their ids
and nothing added: the ids are `apply_chat_template(messages, tokenize=True)`'s.

Trained tokens (loss weight 1): each assistant turn's tokens, from the end of its generation
prompt (what `add_generation_prompt` writes before a reply, e.g. ChatML's
`<|im_start|>assistant\\n`: the role header is not trained) through the end-of-turn token after
its content; everything else weighs 0, anything after the end-of-turn included (ChatML's
newline). A template with `{% generation %}` blocks says itself which text is the assistant's:
those blocks are trained. Otherwise the turn's start is where the rendering of the messages before
it with the generation prompt ends, when the whole conversation's rendering begins with it (a
template that writes something of its own there, as Qwen3's empty think block, has the assistant
write it), else where its content starts; and its end is found by locating each message's
content in the rendered text in order (as written, else without its surrounding whitespace, as
templates that trim it write it): an assistant's at the first place followed, after whitespace
only, by an end-of-turn token (the control token the template writes after the assistant turns
of a probe conversation), another's where a control token follows it, else anywhere. A token is
trained when its first character is. A conversation whose assistant turn cannot be found so is a
BadConversation; a template that ends no turn with a control token is a DataError.

The default template, for a tokenizer without one, is ChatML: `<|im_start|>{role}\\n{content}`
and the end of turn, then a newline, for every message; the generation prompt is
`<|im_start|>assistant\\n`. The end of turn is `<|im_end|>` when the tokenizer has that control
token (Qwen's), else the tokenizer's eos (lmsys's SentencePiece tokenizers, GPT-2's).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmsys.core.errors import DataError
from lmsys.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
PROBE = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye then"},
]

Message = dict[str, str]


class BadConversation(DataError):
    """A line that is not a conversation lmsys can train on; the message says why (lmsys-prepare
    counts and names such lines rather than stopping)."""


# ----------------------------------------------------------------------------- reading


def parse_conversation(line: str) -> list[Message]:
    """The messages of one JSON Lines line (module docstring); BadConversation otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadConversation(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise BadConversation(
            f"a JSON {type(record).__name__}, not an object with messages or prompt/completion"
        )
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        messages = [
            *_turns(record["prompt"], "user", "prompt"),
            *_turns(record["completion"], "assistant", "completion"),
        ]
    else:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise BadConversation(f'neither "messages" nor "prompt" and "completion" (keys: {keys})')
    return checked_messages(messages)


def _turns(value: Any, role: str, key: str) -> list[Any]:
    """A prompt's or completion's messages: a string is one turn of `role`, a list its messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise BadConversation(f'"{key}" is a {type(value).__name__}, not a string or a list of messages')


def checked_messages(messages: Any) -> list[Message]:
    """`messages` as role/content pairs; BadConversation naming the first message that is not one."""
    if not isinstance(messages, list):
        raise BadConversation(f'"messages" is a {type(messages).__name__}, not a list')
    if not messages:
        raise BadConversation("empty conversation (no messages)")
    out = []
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise BadConversation(f"message {n} is a {type(message).__name__}, not an object")
        if "role" not in message:
            raise BadConversation(f"message {n} has no role")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise BadConversation(f"message {n} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            what = "no content" if content is None else f"content of type {type(content).__name__}"
            raise BadConversation(f"message {n} ({role}) has {what}, not a string")
        if role == "assistant" and not content.strip():
            raise BadConversation(f"message {n} (assistant) is empty")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadConversation("no assistant message: nothing to train on")
    return out


# ----------------------------------------------------------------------------- the template


def default_chat_template(tok: Tokenizer) -> str:
    """ChatML with the tokenizer's end of turn: `<|im_end|>` when it is a control token of `tok`,
    else its eos (the module docstring)."""
    end = f"'{CHATML_END}'" if CHATML_END in tok.control_tokens else "eos_token"
    return (
        "{% for message in messages %}"
        f"{{{{ '{CHATML_START}' + message['role'] + '\\n' + message['content'] + {end} + '\\n' }}}}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '{CHATML_START}assistant\\n' }}}}{{% endif %}}"
    )


_SPANS: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("spans", default=None)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body as it is, its place in the output
    recorded while `_recording` is on (transformers' assistant-token tracking)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller: Any) -> str:
        text = caller()
        if (recording := _SPANS.get()) is not None:
            blocks, spans = recording
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


@contextmanager
def _recording() -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
    token = _SPANS.set(([], []))
    try:
        recorded = _SPANS.get()
        assert recorded is not None
        yield recorded
    finally:
        _SPANS.reset(token)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers sets it up for chat templates (module docstring)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A tokenizer's chat template, compiled: render, encode with the trained tokens, prompt."""

    def __init__(self, tok: Tokenizer, template: str | None = None, name: str | None = None):
        """`template`: Jinja text instead of the tokenizer's own (else lmsys's default); `name`
        says where it came from in errors."""
        self.tok = tok
        self.source = template if template is not None else tok.chat_template
        self.is_default = self.source is None
        self.text = default_chat_template(tok) if self.source is None else self.source
        self.name = name or (
            "lmsys's default (ChatML)" if self.is_default else f"the chat template of {tok.path}"
        )
        try:
            self._template = _environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(
                f"{self.name} is not a valid Jinja template: {e.message} (line {e.lineno})"
            ) from e
        self._variables = {f"{name}_token": token for name, token in tok.special_tokens.items()}
        self._end_of_turn: tuple[int, ...] | None = None

    def render(
        self, messages: list[Message], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the character spans of its `{% generation %}` blocks)."""
        with _recording() as (blocks, spans):
            try:
                for block in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self._variables
                ):
                    blocks.append(block)
            except jinja2.TemplateError as e:
                raise BadConversation(f"the chat template refused it: {e.message or e}") from None
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                raise BadConversation(f"the chat template failed on it: {type(e).__name__}: {e}") from None
            return "".join(blocks), list(spans)

    def encode(self, messages: list[Message]) -> tuple[np.ndarray, np.ndarray]:
        """(ids (n,) int64, loss weights (n,) uint8): the conversation rendered and encoded, 1 on
        the assistant's turns (module docstring); BadConversation when they cannot be found."""
        text, spans = self.render(messages)
        ids, starts = self.tok.encode_chat(text)
        if not spans:
            spans = self._assistant_spans(text, messages, ids, starts)
        weights = np.zeros(len(ids), dtype=np.uint8)  # (n,)
        for lo, hi in spans:
            weights[bisect.bisect_left(starts, lo) : bisect.bisect_left(starts, hi)] = 1
        if not weights.any():
            raise BadConversation("the chat template's output has no assistant token to train on")
        return np.asarray(ids, dtype=np.int64), weights

    def prompt(self, messages: list[Message]) -> list[int]:
        """The ids of `messages` rendered with the generation prompt (what the model answers)."""
        text, _ = self.render(messages, add_generation_prompt=True)
        return self.tok.encode_chat(text)[0]

    @property
    def end_of_turn(self) -> tuple[int, ...]:
        """The control tokens that end an assistant turn: those after the assistant turns of a
        probe conversation of two (a template may end its last turn with another token), the
        last turn's first. DataError when the template ends no turn with a control token."""
        if self._end_of_turn is None:
            control = set(self.tok.control_tokens.values())
            try:
                text, _ = self.render(PROBE)
                ids, starts = self.tok.encode_chat(text)
                found, at = [], 0
                for n, message in enumerate(PROBE, 1):
                    if message["role"] == "assistant":
                        lo, hi, i = self._find(text, message["content"], at, ids, starts, control, n)
                        found.append(ids[i])
                        at = hi
            except BadConversation as e:
                raise DataError(f"{self.name}: cannot find its end-of-turn token: {e}") from None
            self._end_of_turn = tuple(dict.fromkeys(found[::-1]))
        return self._end_of_turn

    def _assistant_spans(
        self, text: str, messages: list[Message], ids: list[int], starts: list[int]
    ) -> list[tuple[int, int]]:
        """The character span of each assistant turn, from where its generation prompt ends (else
        its content) through its end-of-turn token (module docstring). Another message is found
        where a control token follows it, else anywhere."""
        control, ends = set(self.tok.control_tokens.values()), set(self.end_of_turn)
        spans, at = [], 0
        for n, message in enumerate(messages, 1):
            content = message["content"]
            if message["role"] == "assistant":
                prompted = self._prompt_end(text, messages[: n - 1])
                if prompted is not None:
                    at = max(at, prompted)
                lo, _, i = self._find(text, content, at, ids, starts, ends, n)
                spans.append((lo if prompted is None else prompted, _token_end(starts, text, i)))
                at = spans[-1][1]
                continue
            try:
                at = self._find(text, content, at, ids, starts, control, n)[1]
            except BadConversation:
                found = _locate(text, content, at)
                at = found[1] if found is not None else at
        return spans

    def _prompt_end(self, text: str, before: list[Message]) -> int | None:
        """Where the generation prompt after the messages `before` ends in `text`, the whole
        conversation's rendering: the length of their rendering with the generation prompt when
        that is how `text` begins (what the model answers in), else None."""
        try:
            prompt, _ = self.render(before, add_generation_prompt=True)
        except BadConversation:  # e.g. a template that reads messages[0] of an empty list
            return None
        return len(prompt) if prompt and text.startswith(prompt) else None

    def _find(
        self, text: str, content: str, at: int, ids: list[int], starts: list[int], ends: set[int], n: int
    ) -> tuple[int, int, int]:
        """(start, end) of message n's `content` in `text` at or after `at`, as written or stripped,
        at the first place one of the tokens `ends` follows it after whitespace only; and that
        token's index in `ids`. BadConversation when there is no such place."""
        for variant in dict.fromkeys((content, content.strip())):
            pos = at
            while variant and (lo := text.find(variant, pos)) >= 0:
                hi = lo + len(variant)
                i = bisect.bisect_left(starts, hi)  # the first token starting after the content
                while (
                    i < len(ids)
                    and ids[i] not in ends
                    and not text[starts[i] : _token_end(starts, text, i)].strip()
                ):
                    i += 1
                if i < len(ids) and ids[i] in ends:
                    return lo, hi, i
                pos = lo + 1
        raise BadConversation(
            f"the chat template does not write message {n} as it is, followed by an end-of-turn token"
        )


def _token_end(starts: list[int], text: str, i: int) -> int:
    """Where token i's text ends: where the next token starts (the text's end for the last)."""
    return starts[i + 1] if i + 1 < len(starts) else len(text)


def _locate(text: str, content: str, at: int) -> tuple[int, int] | None:
    """(start, end) of `content` in `text` at or after `at`, as written or stripped; None if absent."""
    for variant in dict.fromkeys((content, content.strip())):
        if variant and (lo := text.find(variant, at)) >= 0:
            return lo, lo + len(variant)
    return None
