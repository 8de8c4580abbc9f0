#!/usr/bin/env python
"""The `zero_to_fp32.py` of an lmsys run's checkpoints/ folder: DeepSpeed's consolidation of ZeRO
checkpoints into one state dict (`deepspeed.utils.zero_to_fp32`, the same arguments and output
files), made to work on every lmsys model and to read checkpoints weights-only.

    python zero_to_fp32.py . out/ --safe_serialization     # out/model.safetensors
    python zero_to_fp32.py . out/ --tag step_0000100       # out/pytorch_model.bin
    python zero_to_torch.py . out/ --dtype bf16 --safe_serialization   # DeepSpeed's, beside it

DeepSpeed copies its own script into the folder at every save; lmsys writes this file over it when
it commits the checkpoint (lmsys.engine.checkpoint), since DeepSpeed's fails with
--safe_serialization on a model whose embedding and unembedding share one tensor
(`tied_embeddings`, GPT-2's presets): safetensors refuses two names of one storage. Here each
such name is saved as a tensor of its own (equal values; loading the file into a model with
`load_state_dict` ties nothing and needs nothing), and every checkpoint file is read with
`torch.load(weights_only=True)`: nothing in it is unpickled as code. Without
--safe_serialization shared tensors stay shared, as torch.save keeps them. Needs torch and
deepspeed (safetensors and huggingface_hub for the options that use them), not lmsys.

lmsys's own tools read the same checkpoints (lmsys-export: safetensors, config and tokenizer in
one directory). lmsys imports this module for its weights-only loads (`safe_torch_load`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEEPSPEED_MODULE = "deepspeed.utils.zero_to_fp32"
debug = 0  # zero_to_torch.py sets it, as on DeepSpeed's module

# DeepSpeed pickles a few of its own plain data classes into optimizer-state files. They are
# allowlisted for `torch.load(weights_only=True)`, which only rebuilds these types and tensors;
# anything else in a pickle is refused.
DEEPSPEED_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def _safe_globals() -> list[Any]:
    found = []
    for module, name in DEEPSPEED_SAFE_GLOBALS:
        with contextlib.suppress(Exception):
            found.append(getattr(importlib.import_module(module), name))
    return found


def safe_torch_load(path: Any, map_location: Any = "cpu", mmap: bool | None = None) -> Any:
    """torch.load with weights_only=True (never unpickles code) and DeepSpeed's data classes."""
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class WeightsOnlyTorch:
    """Stands in for the `torch` module inside deepspeed.utils.zero_to_fp32 while it runs, so its
    `torch.load(..., weights_only=False)` calls become weights-only loads."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(
        f: Any, map_location: Any = None, weights_only: bool | None = None, mmap: bool | None = None, **_: Any
    ) -> Any:
        return safe_torch_load(f, map_location=map_location, mmap=mmap)


def deepspeed_module() -> Any:
    # imported when used: lmsys imports this module for safe_torch_load, and DeepSpeed must not
    # load before lmsys has chosen how Triton runs (lmsys/engine/zero.py)
    return importlib.import_module(DEEPSPEED_MODULE)


@contextlib.contextmanager
def weights_only(module: Any) -> Iterator[None]:
    """While it runs, `module` (DeepSpeed's zero_to_fp32) loads every file weights-only."""
    original = module.torch
    module.torch = WeightsOnlyTorch()
    try:
        yield
    finally:
        module.torch = original


def separate_shared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every name after the first of a storage given a copy of its own (a tied
    embedding's second name): what safetensors can write."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


@contextlib.contextmanager
def shared_tensors_separated() -> Iterator[None]:
    """While it runs, safetensors' save_file writes shared tensors as separate ones."""
    import safetensors.torch  # only for --safe_serialization, as DeepSpeed's script imports it

    original = safetensors.torch.save_file

    def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: Any = None) -> None:
        original(separate_shared(tensors), filename, metadata=metadata)

    safetensors.torch.save_file = save_file
    try:
        yield
    finally:
        safetensors.torch.save_file = original


def _converter(name: str) -> Callable[..., Any]:
    """DeepSpeed's converter `name`, reading weights-only and separating shared tensors for
    safetensors."""

    def convert(*args: Any, **kwargs: Any) -> Any:
        module = deepspeed_module()
        module.debug = debug
        safe = kwargs.get("safe_serialization", False)
        with weights_only(module), shared_tensors_separated() if safe else contextlib.nullcontext():
            return getattr(module, name)(*args, **kwargs)

    convert.__name__ = name
    convert.__doc__ = f"deepspeed.utils.zero_to_fp32.{name}, on every lmsys model (module docstring)."
    return convert


convert_zero_checkpoint_to_fp32_state_dict = _converter("convert_zero_checkpoint_to_fp32_state_dict")
convert_zero_checkpoint_to_state_dict = _converter("convert_zero_checkpoint_to_state_dict")


def __getattr__(name: str) -> Any:
    """The rest of DeepSpeed's module (OUTPUT_DTYPE_NAMES, get_fp32_state_dict_from_zero_checkpoint,
    ...): DeepSpeed's zero_to_torch.py beside this file imports it as `zero_to_fp32`."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(deepspeed_module(), name)


def cli(argv: list[str] | None = None) -> int:
    """DeepSpeed's zero_to_fp32.py command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint_dir", help="the checkpoints folder, holding the tag folders and `latest`")
    parser.add_argument("output_dir", help="where the state dict's files go")
    parser.add_argument(
        "--max_shard_size", default="5GB", help="largest file before the state dict is sharded"
    )
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument(
        "-t", "--tag", default=None, help="the checkpoint tag (default: the one `latest` names)"
    )
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's debug output")
    args = parser.parse_args(argv)
    global debug
    debug = int(args.debug)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli())
