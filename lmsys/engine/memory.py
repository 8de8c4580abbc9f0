"""What one rank's tensors hold during a training step, phase by phase (lmsys-plan's memory).

A step's peak is the largest of four moments, each with its own set of live tensors; counting
every tensor at once (the textbook sum) over-predicts, because the loss's buffers, the reduction's
copies and the optimizer's temporaries never coexist. The moments, at the last micro-batch of a
step after the first (Adam's state exists then, and the accumulated gradients of the earlier
micro-batches):

- loss: the forward's saved activations of every block and the loss head at its own peak (the
  chunked loss forms its gradients in the forward, the full one in its backward), beside the
  gradients accumulated so far and, at ZeRO-3 on 2+ ranks, every parameter gathered for the
  forward (kept until its backward: stage3_max_live_parameters);
- backward: one block's backward beside the saved activations of the blocks still to run and
  the gradients formed by then, at the first block to run it or at the last (with activation
  checkpointing the block's forward is recomputed first, with its transient gradients; without,
  the loss or reduce moment holds more on every row measured);
- reduce: the end of the backward: the whole gradient and the copies DeepSpeed reduces
  (ZeRO-0/1 flatten and average a copy of every gradient, ZeRO-2 the bucket and its averaged
  copy, ZeRO-3 the gradients, their reduce-scatter copy and the contiguous bucket);
- step: the optimizer's temporaries (AdamW per parameter at ZeRO-0; over the flat fp32 partition
  from ZeRO-1, with the partition's gradient).

Each figure below was read off torch's allocator events of real CPU runs (lmsys-train
trainer.trace_memory=true, the rows of `python -m tools.bench plan`; docs/planning.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels.reference import lce_default_chunk  # the chunk rule of the chunked loss path
from lmsys.core.config import Config, model_dims
from lmsys.model.shapes import ModelShapes

# ZeRO-3 on 2+ ranks keeps each parameter it gathers for the forward until the backward has used
# it again, up to stage3_max_live_parameters (DeepSpeed's default, 1e9, which lmsys leaves): for
# every model here the whole model, gathered beside the partition.
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
# DeepSpeed's engine all-reduces ZeRO-0's gradients in flattened buffers of at most this many
# elements (its MEMORY_OPT_ALLREDUCE_SIZE)
DS_ALLREDUCE_ELEMENTS = 500_000_000
PHASES = ("loss", "backward", "reduce", "step")


# ----------------------------------------------------------------------------- activations


def _norm_saved(formula: str, affine: bool, d: int) -> tuple[int, int]:
    """(elements per token a norm saves of its own, whether it also keeps its input (0/1)).
    torch's F.layer_norm (sqrt_var_eps) keeps its input and two statistics; the written-out
    formulas (std_plus_eps, exact) keep x - mean, sigma and, with the affine, the normalised x."""
    if formula == "none":
        return 0, 0
    if formula == "sqrt_var_eps":
        return 2, 1
    stats = 2 if formula == "std_plus_eps" else 1  # sigma (and sigma + eps)
    return d + stats + (d if affine else 0), 0


def block_saved_elements(cfg: Config) -> int:
    """Elements per token one block leaves for its backward (torch ops; the Triton kernels save
    the same tensors: the normalised input's statistics, q/k/v, the attention output and its
    log-sum-exp), counted from lmsys/model/transformer.py's Block.forward."""
    m, dims = cfg.model, model_dims(cfg.model)
    d, f, h = m.d_model, dims.d_ff, m.n_heads
    norm_own, norm_in = _norm_saved(m.norm.formula, m.norm.affine, d)
    qk_heads = (h + dims.n_kv_heads) * dims.d_qk  # queries and keys (grouped-query: fewer keys)
    qkv = qk_heads + dims.n_kv_heads * dims.d_vo  # q, k, v (after their biases) saved by attention
    # + its output and log-sum-exp; the heads' concatenation is a view of the output (its layout)
    attention = qkv + h * dims.d_vo + h
    if m.attention.softmax == "matrix":
        attention += 2 * h * cfg.data.seq_len  # the whole score matrix and its softmax per query
    # The Llama family's torch references, counted roughly: the rotation keeps the heads it turns and
    # their rotate_half; QK-norm its input and normalised heads.
    attention += 2 * qk_heads * (int(m.positions.kind == "rotary") + int(m.attention.qk_norm))
    ffn_layer = f if m.ffn.activation == "relu" else 2 * f  # relu backward needs only its output
    if m.ffn.gated:  # phi's input (the gate), the up projection, phi(gate)
        ffn_layer = 3 * f
    if m.ffn.bias_after_activation and m.ffn.bias:
        ffn_layer += f
    ffn = d + ffn_layer * m.ffn.n_hidden_layers  # its input, each hidden layer
    norm = norm_own + norm_in * d
    if m.block == "pre":  # x (norm1's input), N1(x), attention, x + attn (N2's input), N2(y), ffn
        return 2 * norm + d + attention + ffn
    if m.block == "post":  # x, attention, x + attn, N1(.), ffn, y + ffn (N2's input)
        return d + attention + 2 * norm + ffn
    if m.block == "none":  # x, attention, y, ffn
        return d + attention + ffn
    return norm + d + attention + ffn  # parallel: one norm feeds both branches


def saved_activation_bytes(cfg: Config, tokens: int, act_bytes: int) -> int:
    """What the forward of one micro-batch of `tokens` positions leaves for the backward: every
    block's saved tensors (only its input with activation checkpointing) and the final norm's."""
    m = cfg.model
    final = 0
    if m.final_norm:
        own, keeps_input = _norm_saved(m.norm.formula, m.norm.affine, m.d_model)
        final = (own + keeps_input * m.d_model) * tokens * act_bytes
    per_block = m.d_model if cfg.deepspeed.activation_checkpointing else block_saved_elements(cfg)
    return m.n_layers * per_block * tokens * act_bytes + final


def recompute_bytes(cfg: Config, tokens: int, act_bytes: int) -> int:
    """Activation checkpointing's backward: one block's forward again and its transient gradients
    (the gradients of its output and input and of its widest intermediate, the FFN's hidden layer)."""
    f = model_dims(cfg.model).d_ff
    return (block_saved_elements(cfg) + 2 * cfg.model.d_model + 2 * f) * tokens * act_bytes


def loss_head_bytes(cfg: Config, tokens: int, impl: str, act_bytes: int) -> int:
    """The loss's own peak for one micro-batch of `tokens` positions (fp32 arithmetic)."""
    v, d = cfg.model.vocab_size, cfg.model.d_model
    if impl == "full":  # the log-softmax kept by the forward, then in its backward the gradients
        # of the log-probabilities and of the logits: 3 buffers of (tokens, V), and h saved
        upcast = 4 * tokens * v if act_bytes < 4 else 0  # bf16 logits are upcast for the softmax
        return 3 * tokens * v * 4 + upcast + tokens * d * act_bytes
    chunk = lce_default_chunk(tokens, v) if impl == "chunked" else 0
    # in the forward: one (chunk, V) block of logits, h and the gradients of h and W (fp32)
    return 4 * (chunk * v + 2 * tokens * d + v * d)


# ----------------------------------------------------------------------------- the step's peak


@dataclass(frozen=True)
class StepMemory:
    phase: str  # the moment of the peak (PHASES)
    components: dict[str, int]  # what is alive then, by component (bytes per rank)
    host: dict[str, int]  # what offload puts in host memory
    moments: dict[str, dict[str, int]]  # every moment's components

    @property
    def totals(self) -> dict[str, int]:
        return {name: sum(alive.values()) for name, alive in self.moments.items()}


def step_memory(
    cfg: Config,
    shapes: ModelShapes,
    world: int,
    cuda: bool,
    p: int,
    tokens: int,
    loss_impl: str,
    grad_accum: int,
    batch_bytes: int,
) -> StepMemory:
    """The tensors of one rank at each moment of a step (module docstring), and the largest."""
    ds = cfg.deepspeed
    n, stage = shapes.n_params, ds.stage
    part = math.ceil(n / world) if stage else n  # this rank's partition (DeepSpeed pads them equal)
    bucket = min(ds.reduce_bucket_size, n)
    if cuda and ds.contiguous_gradients and stage >= 2:
        bucket = ds.reduce_bucket_size  # allocated whole on CUDA
    accumulating = grad_accum > 1
    wide = 4 if p < 4 else 0  # bf16: DeepSpeed keeps an fp32 copy of what it reduces
    # held all step: parameters, optimizer states (Adam's moments and its fp32 master: at ZeRO-0
    # in fp32 the weights are the master), the gradient kept between micro-batches
    params = n * p
    optimizer = 12 * part if stage else 8 * n + wide * n
    full_grads = n * (p + (wide if stage == 0 else 0))  # ZeRO-1/2 keep bf16 gradients, fp32 partitions
    step_temps = 8 * part  # from ZeRO-1 the partition's fp32 gradient and one AdamW temporary
    if stage == 0:  # the engine's own all-reduce flattens up to 5e8 elements at a time
        held, formed, copies = (
            (full_grads if accumulating else 0),
            full_grads,
            min(n, DS_ALLREDUCE_ELEMENTS) * p,
        )
        step_temps = 2 * 4 * max(shapes.param_numels, default=0)  # per parameter, the largest
    elif stage == 1:  # ZeRO-1 reduces a bucket at a time
        held, formed, copies = (full_grads if accumulating else 0), full_grads, bucket * p
    elif stage == 2:  # the averaged partition between micro-batches; the bucket and its copy
        held, formed, copies = (4 * part if accumulating else 0), bucket * p, bucket * p
    else:  # 2+ ranks: the small parameters whole beside the partition; the fp32 gradient
        # partition, and with offload the host-side one DeepSpeed keeps (on a CPU the same memory)
        small = sum(k for k in shapes.param_numels if k < ds.param_persistence_threshold)
        params = part * p + (small * p if world > 1 else 0)
        held = 4 * part + (4 * part if ds.offload_optimizer else 0)
        formed, copies = bucket * p, 2 * bucket * p  # + their reduce-scatter copy and the bucket
        if world > 1:  # still gathered: the parameters whose backward is yet to run (at the end,
            # the last modules' own: the input embedding and a block)
            copies += max(n - bucket, shapes.input_params + shapes.block_params) * p
        step_temps = (8 if ds.offload_optimizer else 12) * part
    gathered = min(n, DS_MAX_LIVE_PARAMETERS) * p if stage == 3 and world > 1 else 0
    saved = saved_activation_bytes(cfg, tokens, p)
    recompute = recompute_bytes(cfg, tokens, p) if ds.activation_checkpointing else 0
    loss = loss_head_bytes(cfg, tokens, loss_impl, p)
    fresh = 0 if stage == 3 or (stage < 2 and accumulating) else formed  # gradients formed by now
    # a bucket smaller than the model is reduced during the backward, beside the activations of
    # the blocks still to run backward (at the first bucket, the rest of the model's share)
    pending = saved * max(n - bucket, 0) // n if stage >= 2 and n else 0
    moments = {
        "loss": dict(gradients=held, activations=saved, loss_head=loss, zero_buffers=gathered),
        # the backward's worst block: its first (every block's activations, or with checkpointing
        # its input, still kept, few gradients formed) or its last (one block's left, the gradients
        # formed); recompute is 0 without checkpointing
        "backward": max(
            dict(gradients=held, activations=saved + recompute, zero_buffers=gathered),
            dict(gradients=held + fresh, activations=saved // cfg.model.n_layers + recompute),
            key=lambda alive: sum(alive.values()),
        ),
        "reduce": dict(
            gradients=max(held, formed) if stage < 2 else held + formed,
            activations=pending,
            zero_buffers=copies,
        ),
        # ZeRO-1 on 2+ ranks has let the whole gradient go once its partition is averaged
        "step": dict(
            gradients=held if stage >= 2 else 0 if stage == 1 and world > 1 else full_grads,
            workspace=step_temps,
        ),
    }
    host: dict[str, int] = {}
    if ds.offload_optimizer and stage >= 1:
        host["optimizer_states"] = optimizer
        if stage == 3:
            host["gradients"] = 4 * part
        if cuda:
            optimizer = 0
    if ds.offload_param and stage == 3:
        host["parameters"] = part * p
        if cuda:
            params -= part * p
    totals: dict[str, dict[str, int]] = {}
    for name, alive in moments.items():
        components = dict.fromkeys(("gradients", "activations", "loss_head", "zero_buffers", "workspace"), 0)
        components.update(alive)
        components["workspace"] += batch_bytes
        totals[name] = {"parameters": params, "optimizer_states": optimizer, **components}
    phase = max(PHASES, key=lambda name: sum(totals[name].values()))
    return StepMemory(phase, totals[phase], host, totals)
