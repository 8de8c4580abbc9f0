"""What lmsys cannot express of the Llama family is refused by lmsys-import in one line naming what is
supported: sliding-window attention in use, a rope scaling other than default and llama3, an
unknown model_type, a rotary model whose function no architecture has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmsys.core.errors import ExportError
from lmsys.interop.export_dir import import_checkpoint
from tests.fixtures.exports import assert_one_line_error, run_clis
from tests.fixtures.family import CONTEXT

# Config keys that shape the function (transformers' names); head_dim and rope_parameters as
# transformers fills them in.


def test_what_lmsys_cannot_express_is_refused_in_one_line(tmp_path, hf_family):
    sources = {case: _edited(tmp_path, hf_family[family], case, **changes)
               for case, (family, changes, _) in REFUSED.items()}  # fmt: skip
    for case, (_, _, message) in REFUSED.items():  # the function's message, each
        with pytest.raises(ExportError, match=None) as info:
            import_checkpoint(sources[case], tmp_path / f"out-{case}")
        assert message in str(info.value) and "\n" not in str(info.value), (case, info.value)
    # the command's line, for one of them, and a window as long as the context is no window at all
    wide = _edited(tmp_path, hf_family["mistral"], "wide", sliding_window=CONTEXT)
    results = run_clis(
        {
            "sliding": ["lmsys.hf_import", str(sources["sliding"]), f"out={tmp_path / 'o1'}"],
            "wide": ["lmsys.hf_import", str(wide), f"out={tmp_path / 'o2'}"],
        },
        parallel=2,
    )
    assert_one_line_error(results["sliding"], "lmsys-import", REFUSED["sliding"][2])
    assert results["wide"].returncode == 0, results["wide"].stderr
    assert not (tmp_path / "o1").exists() and not list(tmp_path.glob(".tmp-*"))


def _edited(root: Path, source: Path, name: str, **changes) -> Path:
    """A copy of a checkpoint directory whose config.json has `changes` (None deletes a key)."""
    target = root / name
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return target


REFUSED = {
    "sliding": ("mistral", {"sliding_window": 16},
                "sliding-window attention (sliding_window=16, shorter than the context of 64) has no lmsys "
                "equivalent"),
    "qwen-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                     "layer_types": None}, "sliding-window attention (sliding_window=16"),
    "yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
             "rope scaling 'yarn' has no lmsys equivalent; lmsys reads the default rotary positions and "
             "llama3's scaling"),
    "model-type": ("llama", {"model_type": "gemma"}, "has model_type 'gemma'; lmsys reads checkpoints of "
                   "model_type gpt2, llama, qwen2, qwen3, mistral"),
}  # fmt: skip
