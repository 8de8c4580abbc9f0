"""lmsys's SentencePiece model as a Hugging Face tokenizer.json that gives exactly lmsys's ids.

A format=hf export carries, beside lmsys's own `tokenizer.model`, a `tokenizer.json` and a
`tokenizer_config.json` (lmsys.data.tokenizer.write_tokenizer_config) that
`transformers.AutoTokenizer.from_pretrained(export)` loads. The mapping of lmsys's training
options (lmsys/data/tokenizer.py):

    SentencePiece                              tokenizer.json
    identity normalization, no dummy prefix,   normalizer Replace(" " -> "▁"), nothing else;
      extra whitespace kept, " " escaped as ▁    no pre-tokenizer (BPE runs over the whole text)
    BPE over the pieces, highest score first   BPE model: the same vocabulary and ids; a merge
                                                 (a, b) for every split of a piece into two
                                                 pieces, ranked by the piece's score
    byte_fallback                              byte_fallback (pieces <0x00>..<0xFF>, same ids)
    pad/bos/eos/unk control pieces             special added tokens; split_special_tokens=true,
      (never read from text)                     so "</s>" in text is text, as in SentencePiece
    decoding: ▁ -> " ", bytes -> UTF-8         decoder Replace("▁" -> " "), ByteFallback, Fuse

Why the ids agree. SentencePiece's BPE starts from the characters of the text (one outside the
vocabulary as its UTF-8 byte pieces) and repeatedly merges the adjacent pair whose concatenation
is the piece of highest score, the leftmost of equals first; `tokenizers` merges the adjacent
pair of lowest rank, the leftmost of equals first. Ranked by score, they pick the same pair at
every step, with one exception: two different splits of the same piece mergeable at once
(pieces X+Y = Y+Z, as "▁▁"+"▁" = "▁"+"▁▁") tie in SentencePiece, and their ranks decide in
`tokenizers`. No text reaching such a state is known (tests/unit/interop/test_hf_tokenizer.py compares
over ten thousand texts); `write_transformers_tokenizer` compares a broad sample and refuses
to write an export whose ids or text differ anywhere in it.

Two corners cannot be expressed, both outside the encodings of text: decoding an id sequence
whose bytes are not valid UTF-8 (SentencePiece replaces each bad byte by U+FFFD and keeps the
valid characters of the run; the ByteFallback decoder replaces every byte of such a run), and
the unk id (SentencePiece decodes it as " ⁇ ", transformers as "<unk>" or, skipping special
tokens, nothing). lmsys's encodings never contain either (byte fallback spells every character).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import tokenizers
from sentencepiece import sentencepiece_model_pb2 as spm_model
from tokenizers import decoders, normalizers

from lmsys.core.errors import ExportError
from lmsys.core.files import atomic_write_text
from lmsys.data.tokenizer import HF_TOKENIZER_FILE, SPECIAL_NAMES, Tokenizer, write_tokenizer_config

SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_NORMAL = spm_model.ModelProto.SentencePiece.NORMAL
_BYTE = spm_model.ModelProto.SentencePiece.BYTE
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def write_transformers_tokenizer(
    directory: Path, tok: Tokenizer, model_max_length: int | None = None
) -> None:
    """tokenizer.json and tokenizer_config.json for transformers in `directory`, converted from
    the SentencePiece model `tok` and checked on a broad sample to give its ids and text
    (ExportError otherwise). (A tokenizer.json tokenizer is transformers' own: Tokenizer.copy_to.)"""
    atomic_write_text(directory / HF_TOKENIZER_FILE, tokenizer_json(tok.path))
    write_tokenizer_config(directory, tok, model_max_length)
    check_same_tokens(tok, Tokenizer(directory / HF_TOKENIZER_FILE), probe_texts(tok))


def _proto(path: Path) -> spm_model.ModelProto:
    proto = spm_model.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto


def _check_options(proto: spm_model.ModelProto, path: Path) -> None:
    """Refuse a SentencePiece model trained with options the mapping above does not cover."""
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    checks = [
        ("model_type", spm_model.TrainerSpec.ModelType.Name(trainer.model_type), "BPE"),
        ("byte_fallback", trainer.byte_fallback, True),
        ("normalization", norm.name, "identity"),
        ("add_dummy_prefix", norm.add_dummy_prefix, False),
        ("remove_extra_whitespaces", norm.remove_extra_whitespaces, False),
        ("escape_whitespaces", norm.escape_whitespaces, True),
        ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix, False),
    ]
    for option, value, lmsys in checks:
        if value != lmsys:
            raise ExportError(
                f"format=hf cannot give transformers the ids of tokenizer {path}: it was trained with "
                f"{option}={value} (lmsys-prepare trains with {lmsys})"
            )
    odd = next(
        (p.piece for p in proto.pieces if p.type not in (_NORMAL, _BYTE) and p.piece not in _special(proto)),
        None,
    )
    if odd is not None:
        raise ExportError(
            f"format=hf cannot give transformers the ids of tokenizer {path}: it has a user-defined or "
            f"unused piece {odd!r} (lmsys-prepare trains none)"
        )


def _special(proto: spm_model.ModelProto) -> list[str]:
    spec = proto.trainer_spec
    return [proto.pieces[i].piece for i in (spec.pad_id, spec.bos_id, spec.eos_id, spec.unk_id) if i >= 0]


def tokenizer_json(path: Path) -> str:
    """The tokenizer.json (text) of an lmsys SentencePiece model (module docstring)."""
    proto = _proto(path)
    _check_options(proto, path)
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == _NORMAL}
    ranked = []  # (-score of the piece, its id, split position, left, right)
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, cut, left, right))
    ranked.sort()
    specials = dict(zip(SPECIAL_NAMES, _special(proto)))
    model = tokenizers.models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in ranked],
        unk_token=specials["unk"],
        fuse_unk=True,
        byte_fallback=True,
    )
    tk = tokenizers.Tokenizer(model)
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in specials.values()]
    )
    return tk.to_str(pretty=True)


# ----------------------------------------------------------------------------- the check


def probe_texts(tok: Tokenizer, random_texts: int = 400, seed: int = 0) -> list[str]:
    """Texts that exercise a tokenizer broadly: edge cases (empty, whitespace runs, digits, text
    spelling special and byte pieces, control and invisible characters), every piece alone,
    random runs of pieces (merges across their boundaries), and random mixtures of pieces with
    characters of every Unicode plane."""
    rng = random.Random(seed)
    special = set(tok.special_tokens.values())
    pieces = [
        p.replace(SPACE, " ")
        for p in (tok.id_to_piece(i) for i in range(tok.vocab_size))
        if p not in special and not _BYTE_PIECE.fullmatch(p)
    ]
    texts = ["", " ", "\n", "\r\n", "\t", "0123456789", "3.14159 1,000,000", "x \u2581 y",
             "</s><s><pad><unk>", "<0x41><0xFF>", "<|endoftext|>", "\x00\x01\x1b[0m\x7f\x85",
             "\ufeff\u200b\u00a0\u202e", "e\u0301 \U0001f468\u200d\U0001f469"]  # fmt: skip
    for n in range(1, 34):
        texts += [" " * n, f"x{' ' * n}y", "\n" * n, "\t" * (n % 5) + " " * n + "z", "ab" * n, "." * n]
    texts += pieces
    for _ in range(random_texts):
        parts: list[str] = []
        for _ in range(rng.randint(1, 30)):
            roll = rng.random()
            if roll < 0.6 and pieces:
                parts.append(rng.choice(pieces) * (rng.randint(2, 5) if rng.random() < 0.1 else 1))
            elif roll < 0.8:
                parts.append(chr(rng.randrange(0x20, 0x7F)))
            elif roll < 0.9:
                parts.append(rng.choice([" ", "  ", "\n", "\t", "\r", "\x00", "\x0c"]))
            else:
                code = rng.randrange(0x110000)
                parts.append(chr(code) if not 0xD800 <= code < 0xE000 else "\ufffd")
        texts.append("".join(parts))
    return texts


def check_same_tokens(reference: Tokenizer, converted: Tokenizer, texts: list[str]) -> None:
    """ExportError naming the first text whose ids, or whose decoded ids, differ."""
    for text in texts:
        want, got = reference.encode(text), converted.encode(text)
        if want != got:
            raise ExportError(
                f"format=hf: the converted tokenizer.json gives other ids than {reference.path} for "
                f"{text[:60]!r}: {got[:12]} vs {want[:12]}; refusing to write a tokenizer that differs"
            )
        if converted.decode(want) != reference.decode(want):
            raise ExportError(
                f"format=hf: the converted tokenizer.json decodes the ids of {text[:60]!r} differently "
                f"from {reference.path}; refusing to write a tokenizer that differs"
            )
