"""Resuming on another layout: a DeepSpeed checkpoint of any ZeRO stage (0-3), world size and
precision read back parameter by parameter (the fp32 master weights, Adam's two moments and its
step count), and written into an engine of another stage, world size or precision. With
lmsys.engine.zero, the only room that knows how ZeRO lays tensors out.

Why lmsys's own re-partitioning rather than DeepSpeed's universal checkpoint (`ds_to_universal`,
then `"load_universal": true`): with DeepSpeed 0.19.8 and torch's AdamW neither side of the
universal path covers ZeRO stage 0 (ds_to_universal reads ZeRO optimizer partitions, which a
stage-0 checkpoint does not have, and only the ZeRO optimizers can load one), it writes a second
full copy of the state to disk first, and it unpickles with `weights_only=False`. Here the saved
partitions are read in place (memory-mapped, weights-only), one parameter is assembled at a
time, and each rank copies its own slice into the new engine's partitions. Nothing is
recomputed or cast on the way (fp32 in, fp32 out), so a resumed run continues with the
uninterrupted run's losses (tests/integration/training/test_reshard.py).

Saved layouts, per checkpoint tag (`W` = the saving world size):

- stage 0: `mp_rank_00_model_states.pt` holds the whole module and the optimizer's state_dict,
  indexed in param-group order; in fp32 the module's weights are the master weights, in bf16 on
  CPU (DeepSpeed's unfused wrapper) the fp32 masters are its `fp32_groups`;
- stage 1, 2 (and DeepSpeed's bf16 optimizer, `bf16_zero_pp_rank_*`): rank r's
  `*zero_pp_rank_{r}_mp_rank_00_optim_states.pt` holds one flat fp32 partition per param group,
  the optimizer state of that partition, and `param_slice_mappings`: where each parameter's
  fragment lies in it (a parameter may span ranks; its fragments follow in rank order);
- stage 3: every parameter is cut into W slices of ceil(n / W) elements (the last one padded);
  rank r's flat fp32 sub-groups hold its slices of the parameters in `param_shapes` order.

Not covered (refused with one line): stage-0 state of DeepSpeed's fused fp16/bf16 wrapper
(`FP16_Optimizer`, CUDA with fused Adam at stage 0) on either side, frozen parameters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lmsys.core.errors import CheckpointError
from lmsys.engine.muon import split_parameters, uses_muon
from lmsys.engine.zero import innermost_optimizer, param_groups, safe_torch_load

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state; "step" is one count per tensor
MUON_MOMENTS = ("momentum_buffer",)  # Muon's (optim=muon's hidden matrices): no step count
ELEMENT_STATES = (*MOMENTS, *MUON_MOMENTS)


@dataclass
class ParamState:
    """One parameter's optimizer-side state, whole (not partitioned), fp32."""

    master: torch.Tensor  # the fp32 master weights, in the parameter's shape
    moments: dict[str, torch.Tensor]  # exp_avg, exp_avg_sq or Muon's momentum_buffer (none before a step)
    step: float | None  # Adam's step count (None before the first step)


def _step(state: dict[str, Any], group: dict[str, Any] | None = None) -> float | None:
    """Adam's step count: in the state (torch: a tensor, DeepSpeed's fused Adam: an int), or in
    the param group (older fused Adam)."""
    value = state.get("step", None if group is None else group.get("step"))
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)


# ----------------------------------------------------------------------------- reading a saved layout


def _load(path: Path) -> dict[str, Any]:
    """A DeepSpeed file, weights-only and memory-mapped: only what is read is paged in (read
    whole if it was saved in torch's legacy format, which cannot be mapped)."""
    try:
        return safe_torch_load(path, mmap=True)
    except Exception:  # the legacy format; a damaged file fails again below
        pass
    try:
        return safe_torch_load(path)
    except Exception as exc:  # a truncated zip, a refused pickle global
        raise CheckpointError(f"cannot read {path}: {' '.join(str(exc).split())[:300]}") from exc


def _rank_files(tag_dir: Path, kind: str, world_size: int) -> list[Path]:
    """`*zero_pp_rank_{r}_mp_rank_00_{kind}.pt` for r = 0..world_size-1 (bf16_ prefix or not)."""
    found: dict[int, Path] = {}
    for path in tag_dir.glob(f"*zero_pp_rank_*_mp_rank_00_{kind}.pt"):
        match = re.search(r"zero_pp_rank_(\d+)_mp_rank_00", path.name)
        if match:
            found[int(match.group(1))] = path
    if sorted(found) != list(range(world_size)):
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved by {world_size} ranks but holds {kind} files of ranks "
            f"{sorted(found)}"
        )
    return [found[r] for r in range(world_size)]


@dataclass
class _Partition:
    """One saved rank's flat fp32 tensors (one per param group or ZeRO-3 sub-group), their
    optimizer states and param groups."""

    flats: list[torch.Tensor]
    states: list[dict[str, Any]]
    groups: list[dict[str, Any]]

    @classmethod
    def of(cls, flats: list[torch.Tensor], optimizer_state: dict[str, Any]) -> _Partition:
        groups = optimizer_state["param_groups"]
        states = [optimizer_state["state"].get(g["params"][0], {}) for g in groups]
        return cls(flats, states, groups)

    def piece(self, group: int, start: int, numel: int) -> dict[str, torch.Tensor]:
        """master and moments of elements [start, start + numel) of flat `group`."""
        out = {"master": self.flats[group].narrow(0, start, numel)}
        for key in ELEMENT_STATES:
            if key in self.states[group]:
                out[key] = self.states[group][key].narrow(0, start, numel)
        return out


def _join(pieces: list[dict[str, torch.Tensor]], shape: torch.Size, step: float | None) -> ParamState:
    """The pieces of one parameter, in order, as its whole state (trailing padding dropped)."""
    n = shape.numel()
    whole = {k: torch.cat([p[k] for p in pieces])[:n].float().view(shape) for k in pieces[0]}
    master = whole.pop("master")
    complete = set(whole) in ({*MOMENTS}, {*MUON_MOMENTS})
    return ParamState(master, whole if complete else {}, step)


class SavedState:
    """The optimizer-side state of a saved checkpoint tag, assembled one parameter at a time."""

    def __init__(self, tag_dir: Path, zero_stage: int, world_size: int, names: list[str]) -> None:
        """names: every trainable parameter, in the order the optimizer's param groups list them
        (stage 0 indexes its optimizer state by that position)."""
        self.tag_dir, self.world_size = tag_dir, world_size
        self.counters: dict[str, int] = {}
        self.loss_scaler: Any = None
        if zero_stage == 3:
            self._read_stage3()
        elif list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
            self._read_fragments()
        else:
            self._read_replicated(names)

    def _read_counters(self, model_states: dict[str, Any]) -> None:
        for key in ("global_steps", "global_samples", "skipped_steps"):
            if isinstance(model_states.get(key), int):
                self.counters[key] = model_states[key]

    def _read_replicated(self, names: list[str]) -> None:
        """Stage 0: one file of whole tensors."""
        model_file = self.tag_dir / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            raise CheckpointError(f"checkpoint {self.tag_dir} has no ZeRO partitions, no {model_file.name}")
        saved = _load(model_file)
        self._read_counters(saved)
        optimizer = saved.get("optimizer")
        if not isinstance(optimizer, dict) or "fp32_groups_flat" in optimizer:
            raise CheckpointError(
                f"{model_file}: lmsys cannot reshard ZeRO-0 state of DeepSpeed's fused fp16/bf16 optimizer; "
                "resume with the checkpoint's deepspeed.stage, world size and precision"
            )
        inner = optimizer.get("optimizer_state_dict", optimizer)  # the unfused bf16 wrapper, or none
        positions = [i for group in inner["param_groups"] for i in group["params"]]
        if len(positions) != len(names):
            raise CheckpointError(
                f"{model_file}: {len(positions)} parameters in its optimizer, {len(names)} in the model"
            )
        masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
        module = saved["module"]
        self._replicated = {
            name: (masters[k] if masters else module[name], inner["state"].get(i, {}))
            for k, (name, i) in enumerate(zip(names, positions))
        }

    def _read_fragments(self) -> None:
        """Stage 1, 2, bf16: flat partitions with the address of each parameter's fragment."""
        self._read_counters(_load(self.tag_dir / "mp_rank_00_model_states.pt"))
        self._partitions: list[_Partition] = []
        self._fragments: dict[str, list[tuple[int, int, int, int]]] = {}  # name: (rank, group, start, numel)
        for rank, path in enumerate(_rank_files(self.tag_dir, "optim_states", self.world_size)):
            osd = _load(path)["optimizer_state_dict"]
            base = osd.get("base_optimizer_state")
            if not isinstance(base, dict) or "param_slice_mappings" not in osd:
                raise CheckpointError(
                    f"{path}: an elastic or pre-0.10 DeepSpeed layout; lmsys cannot reshard"
                )
            self.loss_scaler = osd.get("loss_scaler")
            self._partitions.append(_Partition.of(osd["single_partition_of_fp32_groups"], base))
            for group, mapping in enumerate(osd["param_slice_mappings"]):
                for name, address in mapping.items():
                    self._fragments.setdefault(name, []).append((rank, group, address.start, address.numel))

    def _read_stage3(self) -> None:
        """Stage 3: every parameter cut into world_size slices."""
        first = _load(_rank_files(self.tag_dir, "model_states", self.world_size)[0])
        self._read_counters(first)
        if first.get("frozen_param_shapes"):
            raise CheckpointError(f"checkpoint {self.tag_dir} has frozen parameters; lmsys cannot reshard it")
        shapes = {name: torch.Size(s) for group in first["param_shapes"] for name, s in group.items()}
        self._partitions = []
        for path in _rank_files(self.tag_dir, "optim_states", self.world_size):
            osd = _load(path)["optimizer_state_dict"]
            self.loss_scaler = osd.get("loss_scaler")
            self._partitions.append(_Partition.of(osd["fp32_flat_groups"], osd["optimizer_state_dict"]))
        # Parameters fill the sub-groups in order; a slice never spans two sub-groups.
        capacities = [flat.numel() for flat in self._partitions[0].flats]
        self._slices: dict[str, tuple[torch.Size, int, int, int]] = {}  # name: (shape, group, offset, numel)
        group, offset = 0, 0
        for name, shape in shapes.items():
            part = math.ceil(shape.numel() / self.world_size)
            while group < len(capacities) and offset + part > capacities[group]:
                group, offset = group + 1, 0
            if group == len(capacities):
                raise CheckpointError(f"checkpoint {self.tag_dir}: its ZeRO-3 partitions end before {name}")
            self._slices[name] = (shape, group, offset, part)
            offset += part

    def param(self, name: str, shape: torch.Size) -> ParamState:
        """The whole state of parameter `name`, whose shape in the model is `shape`."""
        if hasattr(self, "_replicated"):
            master, state = self._replicated[name]
            moments = {k: state[k] for k in ELEMENT_STATES if k in state}
            pieces = [{"master": master.reshape(-1), **{k: v.reshape(-1) for k, v in moments.items()}}]
            result = _join(pieces, master.shape, _step(state))
        elif hasattr(self, "_fragments"):
            where = self._fragments.get(name, [])
            pieces = [self._partitions[r].piece(g, start, n) for r, g, start, n in where]
            if sum(p["master"].numel() for p in pieces) != shape.numel():
                raise CheckpointError(f"checkpoint {self.tag_dir} holds no complete {name} {tuple(shape)}")
            r, g = where[0][:2]
            result = _join(pieces, shape, _step(self._partitions[r].states[g], self._partitions[r].groups[g]))
        else:
            if name not in self._slices:
                raise CheckpointError(f"checkpoint {self.tag_dir} holds no {name}")
            saved_shape, g, offset, part = self._slices[name]
            pieces = [p.piece(g, offset, part) for p in self._partitions]
            first = self._partitions[0]
            result = _join(pieces, saved_shape, _step(first.states[g], first.groups[g]))
        if result.master.shape != shape:
            raise CheckpointError(
                f"checkpoint {self.tag_dir}: {name} is {tuple(result.master.shape)}, not {tuple(shape)}"
            )
        return result


# ----------------------------------------------------------------------------- writing into an engine


def trainable_in_optimizer_order(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) in the order lmsys.engine.zero.param_groups (or, for a module trained
    with optim=muon, lmsys.engine.muon.split_parameters) hands them to the optimizer."""
    names = {id(p): name for name, p in module.named_parameters()}
    if uses_muon(module):
        return [(names[id(p)], p) for part in split_parameters(module) for p in part]
    return [(names[id(p)], p) for group in param_groups(module, 0.0) for p in group["params"]]


class _Writer:
    """Puts whole parameter states into the (inner, torch or fused Adam) optimizer's tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.tensor_steps = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        self.steps: dict[int, float] = {}  # id(flat tensor) -> its step count

    def state_of(self, flat: torch.Tensor, moments: tuple[str, ...] = MOMENTS) -> dict[str, Any]:
        """The optimizer's state of one tensor it updates, created now if it has not stepped
        yet (Adam and Muon create their state lazily and keep what they find): `moments` are
        the per-element keys (Adam's, with a step count, or Muon's, without)."""
        state = self.optimizer.state[flat]
        if not all(k in state for k in moments):
            if moments == MOMENTS:
                state["step"] = torch.zeros((), dtype=torch.float32) if self.tensor_steps else 0
            state.update({k: torch.zeros_like(flat, dtype=torch.float32) for k in moments})
        return state

    def set_step(self, flat: torch.Tensor, step: float | None) -> None:
        """One flat tensor holds many parameters and one step count: they must agree."""
        if step is None:
            return
        if self.steps.setdefault(id(flat), step) != step:
            raise CheckpointError(
                f"the checkpoint's parameters were stepped {self.steps[id(flat)]:g} and {step:g} times; "
                "parameters that share a ZeRO partition must agree"
            )
        state = self.state_of(flat)
        state["step"] = torch.tensor(step, dtype=torch.float32) if self.tensor_steps else int(step)

    def copy(self, tensor: torch.Tensor, offset: int, state: ParamState, values: slice) -> None:
        """Elements `values` of the flattened parameter into tensor[offset:...] (flattened), and
        the same elements of its moments into the optimizer's state of `tensor`."""
        numel = values.stop - values.start
        optimizer_state = self.state_of(tensor, tuple(state.moments) or MOMENTS)
        for key, whole in [("master", state.master), *state.moments.items()]:
            target = tensor if key == "master" else optimizer_state[key]
            target.view(-1).narrow(0, offset, numel).copy_(whole.reshape(-1)[values])
        self.set_step(tensor, state.step)


def _load_replicated(engine: Any, saved: SavedState, writer: _Writer) -> None:
    """ZeRO 0: whole parameters; in fp32 the optimizer updates the module's own, in bf16 on CPU
    (the unfused wrapper) fp32 copies of them, in the same order."""
    params = trainable_in_optimizer_order(engine.module)
    copies = [t for group in getattr(engine.optimizer, "fp32_groups", []) for t in group]
    for k, (name, p) in enumerate(params):
        state = saved.param(name, p.shape)
        p.data.copy_(state.master.to(p.dtype))
        writer.copy(copies[k] if copies else p, 0, state, slice(0, p.numel()))


def _load_fragments(engine: Any, saved: SavedState, writer: _Writer) -> None:
    """ZeRO 1, 2 (and DeepSpeed's bf16 optimizer): every rank holds every parameter in the
    compute precision, and owns a fragment of some of them in one flat fp32 partition per param
    group, at the addresses DeepSpeed keeps in each parameter's `_hp_mapping`."""
    flats = [group["params"][0] for group in writer.optimizer.param_groups]
    for name, p in trainable_in_optimizer_order(engine.module):
        state = saved.param(name, p.shape)
        p.data.copy_(state.master.to(p.dtype))
        fragment = p._hp_mapping
        if fragment is None:  # no element of it in this rank's partition
            continue
        lp, hp = fragment.lp_fragment_address, fragment.hp_fragment_address
        writer.copy(flats[fragment.param_group_index], hp.start, state, slice(lp.start, lp.start + lp.numel))


def _load_stage3(engine: Any, saved: SavedState, writer: _Writer) -> None:
    """ZeRO 3: this rank holds slice `rank` of every parameter (ceil(n / world) elements, the last
    one padded) in the compute precision (the parameter's ds_tensor), and in fp32 with its
    optimizer state at the sub-group and offset DeepSpeed records in grad_position."""
    zero = engine.optimizer
    world, rank = dist.get_world_size(), dist.get_rank()
    zero.checkpoint_event_prologue()  # as DeepSpeed's own load: every parameter partitioned first
    for name, p in trainable_in_optimizer_order(engine.module):
        state = saved.param(name, torch.Size(p.ds_shape))
        group, offset, part = zero.grad_position[zero.get_param_id(p)]
        moments = {k: torch.zeros(part * world) for k in state.moments}
        padded = ParamState(torch.zeros(part * world), moments, state.step)
        for key, whole in [("master", state.master), *state.moments.items()]:
            target = padded.master if key == "master" else padded.moments[key]
            target[: whole.numel()] = whole.reshape(-1)
        mine = slice(rank * part, (rank + 1) * part)
        writer.copy(zero.fp32_partitioned_groups_flat[group], offset, padded, mine)
        p.ds_tensor.data.copy_(padded.master[mine].to(p.ds_tensor.dtype))
    zero.checkpoint_event_epilogue()  # the persistent (small, kept whole) parameters gathered again


def load_resharded(engine: Any, tag_dir: Path, zero_stage: int, world_size: int) -> None:
    """Load the checkpoint tag saved at `zero_stage` by `world_size` ranks into `engine`, whatever
    its own stage, world size and precision: master weights, Adam's moments and step counts as
    saved, DeepSpeed's step counters too. Every rank calls this; it reads every saved partition."""
    names = [name for name, _ in trainable_in_optimizer_order(engine.module)]
    saved = SavedState(tag_dir, zero_stage, world_size, names)
    optimizer = innermost_optimizer(engine.optimizer)
    wrapper = type(engine.optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer) or wrapper == "FP16_Optimizer":
        raise CheckpointError(
            f"lmsys cannot reshard into ZeRO-{engine.zero_optimization_stage()} with DeepSpeed's {wrapper}; "
            "resume with the checkpoint's deepspeed.stage, world size and precision"
        )
    writer = _Writer(optimizer)
    with torch.no_grad():
        if engine.zero_optimization_stage() == 3:
            _load_stage3(engine, saved, writer)
        elif any(hasattr(p, "_hp_mapping") for p in engine.module.parameters()):
            _load_fragments(engine, saved, writer)
        else:
            _load_replicated(engine, saved, writer)
    for key, value in saved.counters.items():
        setattr(engine, key, value)
    if type(saved.loss_scaler) is type(getattr(engine.optimizer, "loss_scaler", None)):
        engine.optimizer.loss_scaler = saved.loss_scaler  # fp16's dynamic scale goes on where it was
