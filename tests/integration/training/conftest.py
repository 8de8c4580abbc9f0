"""Fixtures of the training tests: one small prepared dataset, and the runs of the matrix
(tests/integration/features.py), both made once for every worker of the session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.features import REPO_ROOT, VOCAB, RunCache, child_env
from tests.sharing import made_once, shared_dir
from tests.stdlib_text import module_docstrings


def _write_corpus(directory: Path) -> None:
    """~380 KB of English: docstrings of some standard-library modules (deterministic per Python),
    one document per docstring (a .jsonl line), so that document boundaries are frequent enough
    for data.mask_doc_boundaries to give the ranks different loss-weight sums."""
    directory.mkdir(parents=True, exist_ok=True)
    modules = [
        "json", "argparse", "collections", "functools", "itertools", "pathlib", "re", "os", "random",
        "string", "textwrap", "typing", "dataclasses", "heapq", "bisect", "statistics", "fractions",
        "decimal", "datetime", "calendar",
    ]  # fmt: skip
    with open(directory / "docstrings.jsonl", "w", encoding="utf-8") as f:
        for name in modules:
            for doc in module_docstrings(name):
                if doc.strip():
                    f.write(json.dumps({"text": doc}) + "\n")


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory) -> Path:
    """A prepared dataset (vocabulary 512) made once via `python -m lmsys.prepare`."""

    def make(root: Path) -> None:
        corpus, out = root / "corpus", root / "prepared"
        _write_corpus(corpus)
        proc = subprocess.run(
            [sys.executable, "-m", "lmsys.prepare", f"data.sources=[{corpus}]", f"data.dir={out}",
             f"model.vocab_size={VOCAB}", "data.val_fraction=0.1"],
            cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    return made_once(tmp_path_factory, "train_data", make) / "prepared"


@pytest.fixture(scope="session")
def runs(tmp_path_factory, prepared_data) -> RunCache:
    return RunCache(shared_dir(tmp_path_factory, "train_runs"), prepared_data)
