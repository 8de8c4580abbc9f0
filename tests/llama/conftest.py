"""Fixtures of the Llama family's tests, made once per session (per worker under xdist: each takes
seconds): a byte-level BPE tokenizer trained on docstrings, and for each of Llama, Qwen2, Qwen3 and
Mistral a random-weight transformers checkpoint directory (tests/hf_files.py: FAMILY_VARIANTS says
which corner each covers; Mistral's weights in shards with their index), and its lmsys import."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_files import EOS, random_family_model, save_family_directory, train_byte_level_bpe
from tests.stdlib_text import module_docstrings

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
PIECES = 384  # the tokenizer's pieces; Qwen2 and Qwen3 pad their embeddings past them
CONTEXT = 64  # max_position_embeddings
CORPUS_MODULES = ["json", "argparse", "collections", "functools", "itertools", "textwrap", "string", "heapq"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: a second intra-op thread only adds synchronisation on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="session")
def family_tokenizer():
    """A byte-level BPE of PIECES pieces, `<|endoftext|>` (the end of text) the last."""
    texts = [doc for name in CORPUS_MODULES for doc in module_docstrings(name)]
    tokenizer = train_byte_level_bpe(texts, PIECES)
    assert tokenizer.token_to_id(EOS) == PIECES - 1
    return tokenizer


@pytest.fixture(scope="session")
def hf_family(tmp_path_factory, family_tokenizer, transformers) -> dict[str, Path]:
    """model_type -> a transformers checkpoint directory of FAMILY_VARIANTS[model_type]."""
    root = tmp_path_factory.mktemp("hf_family")
    dirs = {}
    for i, model_type in enumerate(FAMILIES):
        model = random_family_model(model_type, PIECES, PIECES - 1, n_positions=CONTEXT, seed=i)
        shards = "40KB" if model_type == "mistral" else None
        dirs[model_type] = save_family_directory(root / f"{model_type}-test", model, family_tokenizer, shards)
    assert (dirs["mistral"] / "model.safetensors.index.json").is_file()
    return dirs


@pytest.fixture(scope="session")
def family_imports(tmp_path_factory, hf_family) -> dict[str, Path]:
    """model_type -> lmsys-import's export (lmsys format) of hf_family[model_type]."""
    from lmsys.interop.export_dir import import_checkpoint

    root = tmp_path_factory.mktemp("family_imports")
    return {t: import_checkpoint(d, root / d.name) for t, d in hf_family.items()}
