"""The tokenizer a run trains with: the copy its run directory keeps, and the one rule that finds
a checkpoint's tokenizer for resume, export, generation and evaluation.

    <run_dir>/tokenizer/     tokenizer.model, or tokenizer.json with its tokenizer_config.json

A prepared data directory can be prepared again (`data.overwrite=true`), moved or deleted while
runs trained on it live on; their checkpoints record only the tokenizer's sha256. So rank 0 copies
the data's tokenizer into the run directory when a launch opens it (`keep_tokenizer`), and
`find_tokenizer` looks there before the data directory. The copy is checked against the sha256 the
data was opened with, so a data directory replaced between the launch's checks and the copy is
refused rather than copied.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lmsys.core.errors import CheckpointError, DataError
from lmsys.core.files import install_dir, sha256_file, sibling
from lmsys.data.tokenizer import CHAT_TEMPLATE_FILE, HF_TOKENIZER_CONFIG, TOKENIZER_FILES

TOKENIZER_DIR = "tokenizer"


def keep_tokenizer(run_dir: Path, tokenizer_file: Path, sha256: str) -> Path:
    """`<run_dir>/tokenizer/`, holding a copy of `tokenizer_file` (and, beside a tokenizer.json, the
    tokenizer_config.json naming its special tokens; a chat_template.jinja beside it) whose sha256
    must be `sha256`: the tokenizer the data was opened with. Kept as it is when it already holds
    that tokenizer; else written next to it and renamed into place. DataError when the file
    changed since the data was opened."""
    target = run_dir / TOKENIZER_DIR
    if (target / tokenizer_file.name).is_file() and sha256_file(target / tokenizer_file.name) == sha256:
        return target
    tmp = sibling(target, "tmp")
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(tokenizer_file, tmp / tokenizer_file.name)
        config = tokenizer_file.with_name(HF_TOKENIZER_CONFIG)
        if tokenizer_file.suffix == ".json" and config.is_file():
            shutil.copyfile(config, tmp / HF_TOKENIZER_CONFIG)
        template = tokenizer_file.with_name(CHAT_TEMPLATE_FILE)
        if template.is_file():  # the chat template the data was rendered with
            shutil.copyfile(template, tmp / CHAT_TEMPLATE_FILE)
        copied = sha256_file(tmp / tokenizer_file.name)
        if copied != sha256:
            raise DataError(
                f"{tokenizer_file} changed while the run started (sha256 {copied[:12]}, opened as "
                f"{sha256[:12]}): its data directory was prepared again; launch again"
            )
        install_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def find_tokenizer(
    want: str,
    data: dict[str, Any],
    tag_dir: Path,
    run_dir: Path | None,
    explicit: str | Path | None = None,
) -> Path:
    """The tokenizer file (tokenizer.model or tokenizer.json) of the checkpoint in `tag_dir`, whose
    sha256 must be `want` (the one its train state records): `explicit` (a file, or a directory
    holding one), else one in the checkpoint, the run's `tokenizer/` copy or the run directory,
    else in the prepared data of its config `data` (data.dir, data.tokenizer). CheckpointError
    naming what was found when none matches."""
    if explicit is not None:
        places = [Path(explicit)]
    else:
        places = [tag_dir]
        if run_dir is not None:
            places += [run_dir / TOKENIZER_DIR, run_dir]
        if data.get("dir"):
            places.append(Path(data["dir"]))
            if run_dir is not None and not Path(data["dir"]).is_absolute():
                places.append(run_dir.parent.parent / data["dir"])
        if data.get("tokenizer"):
            places.append(Path(data["tokenizer"]))
    # a directory may hold either kind; a file names itself
    candidates = [p / name for p in places if p.is_dir() for name in TOKENIZER_FILES]
    candidates += [p for p in places if not p.is_dir()]
    seen = []
    for cand in candidates:
        if not cand.is_file():
            if explicit is not None and not Path(explicit).is_dir():
                raise CheckpointError(f"tokenizer={cand} does not exist")
            continue
        sha = sha256_file(cand)
        if sha == want:
            return cand
        seen.append(f"{cand} (sha256 {sha[:12]})")
    if seen:
        raise CheckpointError(
            f"the tokenizer does not match the model: the checkpoint was trained with sha256 "
            f"{want[:12]}, found {', '.join(seen)}; pass tokenizer=<the data dir's tokenizer file>"
        )
    raise CheckpointError(
        f"cannot find the tokenizer of checkpoint {tag_dir} (looked in the checkpoint, the run and "
        f"data.dir={data.get('dir')!r}); pass tokenizer=<path to tokenizer.model or tokenizer.json>"
    )
