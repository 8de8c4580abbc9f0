"""Chat conversations (lmsys/data/chat.py) in this process: rendered as transformers renders
them, the assistant's turns trained.

- For tokenizers with a chat template (ChatML with a default system prompt, one whose last turn
  opens a think block, a Llama-3-like one with bos and trimmed content), built here, the ids lmsys
  renders are transformers' `apply_chat_template(messages, tokenize=True)` for single- and
  multi-turn conversations with and without a system prompt (both input forms), and the weights
  are 1 exactly where transformers' assistant mask is, the mask of the same template with
  `{% generation %}` blocks around each assistant turn (which lmsys also reads itself).
- The default template (a tokenizer without one) is ChatML, ending turns with `<|im_end|>`, or
  with the eos of an lmsys SentencePiece tokenizer.

lmsys-prepare data.format=chat end to end: tests/integration/data/test_chat.py."""

from __future__ import annotations

import json

import pytest

from lmsys.core.errors import DataError
from lmsys.data.chat import BadConversation, ChatTemplate, default_chat_template, parse_conversation
from lmsys.data.tokenizer import Tokenizer
from tests.hf_files import CHAT_TEMPLATES, END_OF_TURN, IM_END, save_chat_tokenizer
from tests.stdlib_text import module_docstrings

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " Four. "},  # spaces: a trimming template drops them
        {"role": "user", "content": "Say assistant"},
        {"role": "assistant", "content": "assistant"},  # its role's name: found after the header
    ],
    [{"role": "user", "content": "Repeat: ok"}, {"role": "assistant", "content": "ok"}],  # the user's suffix
]


@pytest.mark.parametrize("name", list(CHAT_TEMPLATES))
def test_ids_and_weights_are_transformers(template_dirs, name):
    transformers = pytest.importorskip("transformers")
    plain, tagged = template_dirs[name]
    ours, ours_tagged = ChatTemplate(Tokenizer(plain)), ChatTemplate(Tokenizer(tagged))
    auto = transformers.AutoTokenizer.from_pretrained(tagged)
    for messages in CONVERSATIONS:
        ids, weights = ours.encode(messages)
        want = auto.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids.tolist() == want["input_ids"]
        assert weights.tolist() == want["assistant_masks"], auto.decode(ids)
        tagged_ids, tagged_weights = ours_tagged.encode(messages)
        assert tagged_ids.tolist() == ids.tolist() and tagged_weights.tolist() == weights.tolist()
        # independently: the trained text is each assistant turn's content and end of turn
        trained = auto.decode([i for i, w in zip(ids.tolist(), weights.tolist()) if w])
        eot = END_OF_TURN if name == "header" else IM_END
        turns = [
            m["content"].strip() if name == "header" else m["content"]
            for m in messages
            if m["role"] == "assistant"
        ]
        if name == "thinking":  # its last turn opens with the think block the assistant writes
            turns[-1] = f"<think>\n\n</think>\n\n{turns[-1]}"
        assert trained == "".join(f"{turn}{eot}" for turn in turns)
    prompt = ours.prompt(CONVERSATIONS[0][:1])
    assert prompt == auto.apply_chat_template(CONVERSATIONS[0][:1], tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]  # fmt: skip
    assert ours.end_of_turn == (auto.convert_tokens_to_ids(eot),)


def test_the_two_input_forms(template_dirs):
    ours = ChatTemplate(Tokenizer(template_dirs["chatml"][0]))
    pair = json.dumps({"prompt": "Hello there", "completion": "Hi! How can I help?"})
    assert parse_conversation(pair) == CONVERSATIONS[0]
    listed = json.dumps({"prompt": CONVERSATIONS[1][:2], "completion": CONVERSATIONS[1][2:3]})
    assert parse_conversation(listed) == CONVERSATIONS[1][:3]
    same = ours.encode(parse_conversation(json.dumps({"messages": CONVERSATIONS[0], "id": 7})))
    assert [a.tolist() for a in same] == [a.tolist() for a in ours.encode(CONVERSATIONS[0])]


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "not an object"),
        ('{"text": "plain"}', 'neither "messages" nor "prompt"'),
        ('{"messages": []}', "empty conversation"),
        ('{"messages": [{"content": "hi"}]}', "message 1 has no role"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "role 'bot'; roles are system, user, assistant"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content of type int"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}',
            "is empty",
        ),
    ],
)
def test_bad_conversations_say_why(line, reason):
    with pytest.raises(BadConversation, match=reason.replace("(", r"\(").replace("[", r"\[")):
        parse_conversation(line)


def test_the_default_template_is_chatml(tmp_path, chat_bpe, template_dirs):
    """Without a template: ChatML ending turns with <|im_end|> when the tokenizer has it (then it is
    what transformers renders with that template), else with the eos (an lmsys SentencePiece
    tokenizer, whose eos the rendered text spells and the encoding reads as its id)."""
    transformers = pytest.importorskip("transformers")
    bare = save_chat_tokenizer(tmp_path / "bare", chat_bpe, None)
    tok = Tokenizer(bare)
    default = ChatTemplate(tok)
    assert default.is_default and tok.chat_template is None and "'<|im_end|>'" in default.text
    auto = transformers.AutoTokenizer.from_pretrained(bare)
    ids, weights = default.encode(CONVERSATIONS[1])
    want = auto.apply_chat_template(CONVERSATIONS[1], chat_template=default.text, return_dict=True)
    assert ids.tolist() == want["input_ids"]
    assert auto.decode(ids).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n")
    assert weights.sum() > 0


def test_the_default_template_on_a_sentencepiece_tokenizer(tmp_path):
    from lmsys.data.tokenizer import train_tokenizer

    texts = [doc for doc in module_docstrings("json")]
    tok = train_tokenizer(texts, 400, tmp_path / "tokenizer.model")
    template = ChatTemplate(tok)
    assert "eos_token" in template.text and template.end_of_turn == (tok.eos_id,)
    ids, weights = template.encode(CONVERSATIONS[0])
    assert ids.tolist().count(tok.eos_id) == 2  # each turn ends with it
    trained = [i for i, w in zip(ids.tolist(), weights.tolist()) if w]
    assert trained[-1] == tok.eos_id and tok.decode(trained) == "Hi! How can I help?"
    # kept with a copy of the tokenizer, as lmsys-prepare keeps the template it rendered with
    tok.chat_template = template.text
    (tmp_path / "copy").mkdir()
    copy = Tokenizer(tok.copy_to(tmp_path / "copy"))
    assert copy.chat_template == template.text


def test_a_template_that_ends_no_turn_is_one_error(tmp_path, chat_bpe):
    no_end = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = Tokenizer(save_chat_tokenizer(tmp_path / "plain", chat_bpe, no_end))
    with pytest.raises(DataError, match="cannot find its end-of-turn token"):
        ChatTemplate(tok).encode(CONVERSATIONS[0])  # every conversation: the data cannot be prepared
    broken = Tokenizer(save_chat_tokenizer(tmp_path / "broken", chat_bpe, "{% for m in messages %}"))
    with pytest.raises(DataError, match="not a valid Jinja template"):
        ChatTemplate(broken)
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system prompt first') }}{% endif %}"
    )
    tok = Tokenizer(save_chat_tokenizer(tmp_path / "strict", chat_bpe, strict))
    with pytest.raises(BadConversation, match="a system prompt first"):
        ChatTemplate(tok).encode(CONVERSATIONS[0])
    assert default_chat_template(tok).startswith("{% for message in messages %}")
