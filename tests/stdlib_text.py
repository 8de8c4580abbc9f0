"""English text that exists on every machine: docstrings of standard-library modules (the test
corpora of the train, export and launch suites)."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path


def module_docstrings(name: str) -> list[str]:
    """The module's docstring, then those of its public attributes in name order; empty ones dropped."""
    module = importlib.import_module(name)
    docs = [module.__doc__]
    for attr in sorted(dir(module)):
        if attr.startswith("_"):
            continue
        with warnings.catch_warnings():  # typing.io and typing.re are deprecated aliases
            warnings.simplefilter("ignore", DeprecationWarning)
            docs.append(getattr(getattr(module, attr, None), "__doc__", None))
    return [doc for doc in docs if isinstance(doc, str) and doc]


def write_docstring_files(directory: Path, modules: list[str]) -> None:
    """One text file per module, doc_00.txt, doc_01.txt, ...: its docstrings separated by blank lines."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(modules):
        (directory / f"doc_{i:02d}.txt").write_text("\n\n".join(module_docstrings(name)), encoding="utf-8")
