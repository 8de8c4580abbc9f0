"""Static inspection of every kernel for A100 (sm_80) and H100 (sm_90), on a machine without a GPU.

    python -m tools.inspect [--arch 80,90] [--dtype bf16,fp16] [--json FILE] [--dump DIR]
                            [--head-dims 64,128,64/128] [--widths 768,1600] [--masks causal,full]
                            [--loads auto,pointers] [--attn-variants plain,gqa,docs,gqa-docs]
                            [--lce-widths 768,1600] [--lce-variants train,train-bias,eval]
                            [--rms-widths 1024,2048] [--rope-head-dims 64,128] [--glu-widths 3072]
                            [--jobs N] [--candidates]

For every kernel (attention forward, backward preprocess, dK/dV and dQ, plain, with grouped
key/value heads, with documents and with both; layer-norm forward, forward with residual,
backward, backward with the residual gradient, and the row sums of wide backward rows; the same
five with the RMS formula; rotary forward and backward; the gated activation forward and
backward; the fused linear cross-entropy's logits, log-sum-exp, dh and dW kernels), every
head-width case of the model family, every layer-norm width of the presets plus 2048 ... 16384,
the Llama family's widths for RMS norm (d_model and the QK-norm's head widths), rotary and the
gated activation (d_ff), GPT-2's hidden widths for the loss, and every listed tiling the runtime
keeps for the target
(`KernelLaunch.kept`: the candidates of the head width and GPU generation that fit its shared
memory), the kernel is compiled exactly as a launch would compile it on that GPU (the launchers'
own `KernelLaunch` records, bound by Triton's JIT binder), and one row reports:

    regs        registers per thread (ptxas -v)
    spill       spill stores + loads in bytes per thread (ptxas -v); must be 0
    smem        dynamic shared memory per CTA
    CTA/SM      CTAs resident per SM (CUDA occupancy rules), occ = resident warps / 64, and the
                resources that bound it (registers, smem, warps, blocks)
    launch      whether one CTA fits the target at all (shared memory, registers, threads)
    mma         wgmma (HGMMA), mma.sync (HMMA) or none, from the SASS
    loads       tma (UTMALDG), cp.async (LDGSTS), ldg: how global memory is read, from the SASS
    loop        SASS instructions per warp in one iteration of the main loop (the unmasked
                tensor-core loop of attention, the row loop of the layer-norm backward)
    inflight    layer norm: bytes of loads in flight per SM, that is the bytes one CTA's LDG
                instructions fetch per loop iteration (the whole kernel when it has no loop; lanes
                of padding columns excluded) times the CTAs resident per SM (at most the grid's
                CTAs per SM). Little's law asks for about peak bandwidth x latency / SMs:
                15 KiB at 3.35 TB/s and 600 ns on an H100, 11 KiB on an A100

Exit status 1 when a listed config spills, cannot launch or fails to compile. `--dump DIR` writes
each cubin as DIR/<kernel>-<arch>-<dtype>-<case>-<config>.cubin and the JSON names it per row.
`--candidates` compiles a wider set of tilings (tools/inspect/candidates.py) for every case as
well, and prints, per kernel, head-width class and target, those that compile without spilling
and launch in every case of the class: what a developer pastes into the kernels' lists. It still
fails on a listed config that does not.

Shapes: attention at B = 2, H = 4, T = 1024 (GPT-2's context) in the model's layout (q, k, v
are (B, T, H, d) projections viewed as (B, H, T, d)), softmax scale 1/sqrt(d_qk); grouped: one
key/value head for the four query heads (GROUP 4); documents: the (B, T) bounds of packed rows;
layer norm over 16384 rows with weight and bias, "sqrt_var_eps", RMS norm with a gain; rotary
over B = 2, T = 1024 with 32 query and 8 key heads, one (T, d) table; the gated activation over
16384 rows; the linear cross-entropy at GPT-2's vocabulary
(V = 50,257) over 8192 tokens, one chunk of the launchers' default size, for training (with and
without an unembedding bias) and for evaluation (no gradients: no logits stored). Tensors live on
the meta device: nothing is allocated, only shapes, strides and dtypes enter the compilation.
Nothing here is a timing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels import runtime
from kernels.runtime import KernelLaunch
from lmsys.cli import run_cli
from lmsys.core.errors import UsageError
from tools.inspect import aot, candidates

# The modules, by import_module: `kernels.flash_attention` / `kernels.layer_norm` the attributes
# may be the public functions (see kernels/__init__.py).
fa = importlib.import_module("kernels.flash_attention")
ln = importlib.import_module("kernels.layer_norm")
lce = importlib.import_module("kernels.linear_cross_entropy")
rope = importlib.import_module("kernels.rotary")
glu = importlib.import_module("kernels.gated")

PROG = "tools.inspect"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Head widths of the model family: tiny (32), GPT-2 and the seeds (64), the powers of two around
# them, and d_qk != d_vo both ways (seed_compact sets them independently).
HEAD_DIMS = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (64, 128), (128, 64))
# Layer-norm widths: every d_model of conf/model (128 ... 1600) and the wide rows beyond them.
WIDTHS = (128, 512, 768, 1024, 1280, 1600, 2048, 4096, 8192, 16384)
MASKS = {"causal": True, "full": False}
LOADS = ("auto", "pointers")
# Attention variants: (query heads per key/value head, documents).
ATTN_VARIANTS = {"plain": (1, False), "gqa": (4, False), "docs": (1, True), "gqa-docs": (4, True)}
# The Llama family's widths: RMS norm at every d_model of its presets (576 smollm2_135m, 896
# qwen2_5_0_5b, 1024 qwen3_0_6b, 2048 llama3_2_1b), the QK-norm's head widths 64 and 128, and the
# wide rows; rotary at its head widths; the gated activation at the presets' d_ff.
RMS_WIDTHS = (64, 128, 576, 896, 1024, 2048, 16384)
ROPE_HEAD_DIMS = (64, 128)
ROPE_HEADS = (32, 8)  # (query heads, key heads): Llama 3.2 1B's
GLU_WIDTHS = (1536, 3072, 4864, 8192)
ATTN_SHAPE = (2, 4, 1024)  # (B, H, T)
LN_ROWS = 16384  # 16 sequences of 1024 tokens
# Linear cross-entropy: GPT-2's vocabulary, 8192 tokens (8 sequences of 1024), the hidden widths of
# gpt2_124m and gpt2_1558m; training with and without an unembedding bias, and evaluation.
LCE_TOKENS = 8192
LCE_VOCAB = 50257
LCE_WIDTHS = (768, 1600)
LCE_VARIANTS = {"train": (False, True), "train-bias": (True, True), "eval": (False, False)}  # (bias, grads)
KERNEL_ORDER = (
    "attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
    "ln_fwd", "ln_fwd_residual", "ln_bwd_row_sums", "ln_bwd", "ln_bwd_residual",
    "rms_fwd", "rms_fwd_residual", "rms_bwd_row_sums", "rms_bwd", "rms_bwd_residual",
    "rope_fwd", "rope_bwd", "glu_fwd", "glu_bwd",
    "lce_fwd", "lce_lse", "lce_bwd_dh", "lce_bwd_dw",
)  # fmt: skip
# The forward loop compared with the Triton tutorial's fused attention (kernels/README.md).
REFERENCE_LOOP = ("attn_fwd", "sm_90", "dqk128-dvo128-causal-tma", "128x128-w8-s2")


# ----------------------------------------------------------------------------------------------
# The cases: the launchers' own launch records, built from meta tensors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One shape of one kernel family on one target; rebuilt by every worker process."""

    family: str  # "attn", "ln", "rms", "rope", "glu" or "lce"
    arch: int  # 80 or 90
    dtype: str  # "bf16" or "fp16"
    d_qk: int = 0
    d_vo: int = 0
    causal: bool = True
    tma: bool = True  # attention: let the launchers use TMA where the target has it
    group: int = 1  # attention: query heads per key/value head
    docs: bool = False  # attention: packed documents
    width: int = 0
    residual: bool = False  # layer norm: the fused residual add (and its gradient)
    bias: bool = False  # linear cross-entropy: an unembedding bias
    grads: bool = True  # linear cross-entropy: gradients wanted (training) or not (evaluation)


def attention_launches(case: Case) -> list[KernelLaunch]:
    """Forward, preprocess, dK/dV and dQ launches, as flash_attention's launchers build them."""
    B, H, T = ATTN_SHAPE
    dtype = DTYPES[case.dtype]
    # The model's layout: one (B, T, H, d) projection per operand, viewed as (B, H, T, d).
    heads = lambda d, h=H: torch.empty((B, T, h, d), dtype=dtype, device="meta").transpose(1, 2)
    h_kv = H // case.group
    q, k, v, do = heads(case.d_qk), heads(case.d_qk, h_kv), heads(case.d_vo, h_kv), heads(case.d_vo)
    o = torch.empty((B, H, T, case.d_vo), dtype=dtype, device="meta")
    lse = torch.empty((B, H, T), dtype=torch.float32, device="meta")
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = 1.0 / math.sqrt(case.d_qk)
    bounds = None
    if case.docs:
        bounds = tuple(torch.empty((B, T), dtype=torch.int32, device="meta") for _ in range(2))
    forward = fa.forward_launch(
        q, k, v, o, lse, case.causal, scale, case.arch, allow_tma=case.tma, bounds=bounds
    )
    backward = fa.backward_launches(
        do,
        q,
        k,
        v,
        o,
        lse,
        delta,
        dq,
        dk,
        dv,
        case.causal,
        scale,
        case.arch,
        allow_tma=case.tma,
        bounds=bounds,
    )
    return [forward, *backward]


def layer_norm_launches(case: Case) -> list[KernelLaunch]:
    """Forward and backward launches of an affine "sqrt_var_eps" layer norm, or of an RMS norm
    with a gain (family "rms"), with the fused residual add when `case.residual`, with the
    geometry the launchers pick on the target."""
    dtype = DTYPES[case.dtype]
    formula = "rms" if case.family == "rms" else "sqrt_var_eps"
    x = torch.empty((LN_ROWS, case.width), dtype=dtype, device="meta")
    weight = torch.empty((case.width,), dtype=dtype, device="meta")
    bias = torch.empty_like(weight) if formula != "rms" else None
    residual = torch.empty_like(x) if case.residual else None
    forward, _ = ln.forward_launch(x, weight, bias, 1e-5, formula, residual)
    mean = torch.empty((LN_ROWS,), dtype=torch.float32, device="meta")
    rstd = torch.empty_like(mean)
    backward, _ = ln.backward_launches(
        torch.empty_like(x), x, mean, rstd, weight, bias, 1e-5, formula,
        torch.empty_like(x) if case.residual else None, aot.TARGETS[case.arch].sm_count,
    )  # fmt: skip
    return [forward, *backward]


def rope_launches(case: Case) -> list[KernelLaunch]:
    """The rotary forward and backward launches over queries and keys in the model's layout."""
    B, _, T = ATTN_SHAPE
    h, h_kv = ROPE_HEADS
    dtype = DTYPES[case.dtype]
    heads = lambda n: torch.empty((B, T, n, case.d_qk), dtype=dtype, device="meta").transpose(1, 2)
    table = torch.empty((T, case.d_qk), dtype=dtype, device="meta")
    q, k = heads(h), heads(h_kv)
    return [rope.rotary_launch(q, k, q, k, table, table, transpose) for transpose in (False, True)]


def glu_launches(case: Case) -> list[KernelLaunch]:
    """The gated activation's (SwiGLU) forward and backward launches over LN_ROWS rows."""
    x = torch.empty((LN_ROWS, case.width), dtype=DTYPES[case.dtype], device="meta")
    return [glu.forward_launch(x, x, x, "silu"), glu.backward_launch(x, x, x, x, x, "silu")]


def lce_launches(case: Case) -> list[KernelLaunch]:
    """One chunk of the linear cross-entropy's launches over LCE_TOKENS tokens, at the launchers'
    default chunk size and with the dh split they pick for the target's SM count."""
    dtype = DTYPES[case.dtype]
    d, v = case.width, LCE_VOCAB
    meta = lambda shape, dt=dtype: torch.empty(shape, dtype=dt, device="meta")
    c = lce.default_chunk(LCE_TOKENS, v)
    h = meta((LCE_TOKENS, d))[:c]  # (C, D): the first chunk of the tokens
    weight = meta((v, d))
    bias = meta((v,)) if case.bias else None
    buffers = lce.chunk_buffers(c, d, v, dtype, "meta", True, case.grads, aot.TARGETS[case.arch].limits)
    dw = meta((v, d), torch.float32) if case.grads else None
    db = meta((v,), torch.float32) if case.grads and case.bias else None
    return lce.chunk_launches(
        h, weight, bias, meta((c,), torch.int64), meta((c,), torch.float32), meta((c,), torch.float32),
        buffers, dw, db, case.grads,
    )  # fmt: skip


def case_launches(case: Case) -> list[KernelLaunch]:
    builders = {
        "attn": attention_launches, "ln": layer_norm_launches, "rms": layer_norm_launches,
        "rope": rope_launches, "glu": glu_launches, "lce": lce_launches,
    }  # fmt: skip
    return builders[case.family](case)


def case_name(case: Case, launch: KernelLaunch) -> str:
    """The shape part of a row's key, e.g. "dqk64-dvo64-causal-tma" for attention."""
    if launch.name == "attn_bwd_preprocess":
        return f"dvo{case.d_vo}"
    if case.family == "attn":
        loads = "tma" if any(launch.kwargs.get(f) for f in ("KV_TMA", "QDO_TMA")) else "ptr"
        variant = (f"-gqa{case.group}" if case.group > 1 else "") + ("-docs" if case.docs else "")
        return f"dqk{case.d_qk}-dvo{case.d_vo}-{'causal' if case.causal else 'full'}{variant}-{loads}"
    if case.family == "rope":
        return f"d{case.d_qk}-h{ROPE_HEADS[0]}-kv{ROPE_HEADS[1]}"
    if case.family == "lce":
        variant = ("-bias" if case.bias else "") + ("" if case.grads else "-eval")
        return f"d{case.width}-v{LCE_VOCAB}{variant}"
    return f"n{case.width}"


def config_name(config: triton.Config) -> str:
    """'128x64-w8-s3': the block sizes in the kernel's order (attention: BLOCK_M x BLOCK_N; the
    loss: output rows x output columns x reduction step), warps, pipeline stages."""
    blocks = "x".join(str(v) for v in config.kwargs.values())
    return f"{blocks}-w{config.num_warps}-s{config.num_stages}"


def tiling(config: triton.Config) -> tuple[tuple[str, int], ...]:
    """A config as plain items, for a worker process: its blocks, warps and stages."""
    return (*config.kwargs.items(), ("num_warps", config.num_warps), ("num_stages", config.num_stages))


def grid_ctas(launch: KernelLaunch) -> int | None:
    """CTAs in the launch's grid when it does not depend on the tiling."""
    return math.prod(launch.grid) if isinstance(launch.grid, tuple) else None


# ----------------------------------------------------------------------------------------------
# One compilation (run in worker processes)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    case: Case
    kernel: str  # launch name within the case
    config: tuple[tuple[str, int], ...]  # the tiling: `tiling(config)`
    listed: bool  # the runtime keeps it for this launch on the target (else a wider candidate)
    dump_dir: str | None


def run_task(task: Task) -> dict:
    launch = next(lc for lc in case_launches(task.case) if lc.name == task.kernel)
    config = runtime.config(dict(task.config))
    target = aot.TARGETS[task.case.arch]
    row = {
        "kernel": launch.name,
        "arch": target.name,
        "dtype": task.case.dtype,
        "case": case_name(task.case, launch),
        "config": config_name(config),
        "tiling": dict(task.config),
        "listed": task.listed,
    }
    if task.case.family == "attn":
        same = task.case.d_qk == task.case.d_vo
        row |= {
            "head_dim": str(task.case.d_qk) if same else f"{task.case.d_qk}/{task.case.d_vo}",
            "d_qk": task.case.d_qk,
            "d_vo": task.case.d_vo,
            "causal": task.case.causal,
            "group": task.case.group,
            "docs": task.case.docs,
            "width": None,
        }
    elif task.case.family == "rope":
        row |= {"head_dim": str(task.case.d_qk), "d_qk": task.case.d_qk, "width": None}
    elif task.case.family == "glu":
        row |= {"head_dim": None, "width": task.case.width}
    elif task.case.family in ("ln", "rms"):
        row |= {"head_dim": None, "width": task.case.width, "residual": task.case.residual}
    else:
        row |= {"head_dim": None, "width": task.case.width, "bias": task.case.bias, "grads": task.case.grads}
    try:
        binary = aot.compile_for_target(launch.kernel, launch.args, launch.kwargs_for(config), target)
        analysis = aot.analyse(binary, target)
    except Exception as e:  # a config that does not compile is a finding, not a crash
        return row | {"error": f"{type(e).__name__}: {e}", "detail": traceback.format_exc(limit=3)}
    occupancy = analysis.occupancy
    resident = occupancy.ctas_per_sm
    if (ctas := grid_ctas(launch)) is not None:
        resident = min(resident, math.ceil(ctas / target.sm_count))
    in_flight = None
    if task.case.family in ("ln", "rms") and analysis.loop_ldg_bytes is not None:
        # Lanes of the padded columns (BLOCK_N > N) are masked off and fetch nothing.
        useful = min(1.0, task.case.width / config.kwargs["BLOCK_N"])
        in_flight = round(analysis.loop_ldg_bytes * useful) * resident
    cubin_path = None
    if task.dump_dir is not None:
        stem = f"{row['kernel']}-{row['arch']}-{row['dtype']}-{row['case']}-{row['config']}"
        cubin_path = str(Path(task.dump_dir) / f"{stem}.cubin")
        Path(cubin_path).write_bytes(binary.cubin)
    return row | {
        "num_warps": analysis.num_warps,
        "num_stages": analysis.num_stages,
        "registers": analysis.usage.registers,
        "spill_bytes": analysis.usage.spill_bytes,
        "spill_store_bytes": analysis.usage.spill_store_bytes,
        "spill_load_bytes": analysis.usage.spill_load_bytes,
        "stack_bytes": analysis.usage.stack_bytes,
        "smem_bytes": analysis.shared_bytes,
        "ctas_per_sm": occupancy.ctas_per_sm,
        "occupancy": round(occupancy.fraction, 4),
        "limiter": "/".join(occupancy.limiters),
        "launchable": occupancy.launchable,
        "problem": occupancy.problem,
        "mma": analysis.mma,
        "tma": "tma" in analysis.load_paths,
        "load_paths": analysis.load_paths,
        "loop_instructions": analysis.loop_instructions,
        "loop_ldg_bytes": analysis.loop_ldg_bytes,
        "grid_ctas": grid_ctas(launch),
        "in_flight_bytes_per_sm": in_flight,
        "compile_s": round(analysis.compile_seconds, 2),
        "cubin": cubin_path,
    }


def _worker_init(cache_dir: str) -> None:
    # Compilations go to a private cache that is thrown away: nothing from an earlier run (or
    # an earlier Triton) can stand in for a compilation.
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    triton.knobs.cache.dir = cache_dir
    torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for arch in args.arch:
        for dtype in args.dtype:
            for (d_qk, d_vo), mask, variant in itertools.product(
                args.head_dims, args.masks, args.attn_variants
            ):
                group, docs = ATTN_VARIANTS[variant]
                attn = dict(causal=MASKS[mask], group=group, docs=docs)
                has_tma = arch >= fa.TMA_MIN_CAPABILITY
                if "auto" in args.loads or not has_tma:  # the launchers' choice: TMA on sm_90
                    cases.append(Case("attn", arch, dtype, d_qk, d_vo, **attn))
                if "pointers" in args.loads and has_tma:
                    # the pointer path that inputs TMA cannot address take on sm_90
                    cases.append(Case("attn", arch, dtype, d_qk, d_vo, tma=False, **attn))
            for family, widths in (("ln", args.widths), ("rms", args.rms_widths)):
                for width in widths:
                    for residual in (False, True):
                        cases.append(Case(family, arch, dtype, width=width, residual=residual))
            cases += [Case("rope", arch, dtype, d_qk=d, d_vo=d) for d in args.rope_head_dims]
            cases += [Case("glu", arch, dtype, width=width) for width in args.glu_widths]
            for width in args.lce_widths:
                for variant in args.lce_variants:
                    bias, grads = LCE_VARIANTS[variant]
                    cases.append(Case("lce", arch, dtype, width=width, bias=bias, grads=grads))
    return cases


def build_tasks(cases: list[Case], wider: bool, dump_dir: str | None) -> list[Task]:
    """Compilation tasks, deduplicated (the preprocess does not depend on the mask): the tilings the
    runtime keeps for each launch on its target, and with `wider` the candidates mode's set."""
    tasks, seen = [], set()
    for case in cases:
        target = aot.TARGETS[case.arch]
        for launch in case_launches(case):
            kept = launch.kept(target.limits)
            configs = [*kept, *(candidates.wider_set(launch, case.dtype) if wider else [])]
            listed = {config_name(c) for c in kept}
            for config in configs:
                key = (launch.name, target.name, case.dtype, case_name(case, launch), config_name(config))
                if key in seen:
                    continue
                seen.add(key)
                tasks.append(Task(case, launch.name, tiling(config), config_name(config) in listed, dump_dir))
    return tasks


def row_key(row: dict) -> tuple[str, str, str, str, str]:
    return (row["kernel"], row["arch"], row["dtype"], row["case"], row["config"])


def run_tasks(tasks: list[Task], jobs: int) -> list[dict]:
    rows = []
    # the workers stop before their cache goes: a failed compilation's own error is what is
    # reported, not the cache's removal under a worker still writing to it
    cache = tempfile.TemporaryDirectory(prefix="kernels-inspect-cache-", ignore_cleanup_errors=True)
    with cache as cache_dir:
        pool = None
        if jobs <= 1:
            _worker_init(cache_dir)
            results = map(run_task, tasks)
        else:
            pool = concurrent.futures.ProcessPoolExecutor(
                jobs, initializer=_worker_init, initargs=(cache_dir,)
            )
            results = pool.map(run_task, tasks, chunksize=1)
        start = time.perf_counter()
        try:
            for i, row in enumerate(results, 1):
                rows.append(row)
                if i % 20 == 0 or i == len(tasks):
                    elapsed = time.perf_counter() - start
                    print(f"  compiled {i}/{len(tasks)} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    return rows


def _kib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1024:.1f}"


def format_rows(rows: list[dict], show_listed: bool) -> str:
    columns = [
        ("kernel", lambda r: r["kernel"]),
        ("arch", lambda r: r["arch"]),
        ("dtype", lambda r: r["dtype"]),
        ("shape", lambda r: r["case"]),
        ("config", lambda r: r["config"]),
        ("regs", lambda r: str(r.get("registers", "-"))),
        ("spill", lambda r: str(r.get("spill_bytes", "-"))),
        ("smemKB", lambda r: _kib(r.get("smem_bytes"))),
        ("CTA/SM", lambda r: str(r.get("ctas_per_sm", "-"))),
        ("occ", lambda r: f"{r['occupancy']:.0%}" if "occupancy" in r else "-"),
        ("limit", lambda r: r.get("limiter", "-") or "-"),
        ("launch", lambda r: ("yes" if r["launchable"] else "NO") if "launchable" in r else "-"),
        ("mma", lambda r: r.get("mma", "-")),
        ("loads", lambda r: "+".join(r.get("load_paths", [])) or "-"),
        ("loop", lambda r: str(r.get("loop_instructions") or "-")),
        ("inflightKB/SM", lambda r: _kib(r.get("in_flight_bytes_per_sm"))),
    ]
    if show_listed:
        columns.append(("listed", lambda r: "yes" if r["listed"] else "no"))
    columns.append(("note", lambda r: r.get("error", r.get("problem", ""))[:80]))
    cells = [[fn(r) for _, fn in columns] for r in rows]
    widths = [
        max(len(name), *(len(c[i]) for c in cells)) if cells else len(name)
        for i, (name, _) in enumerate(columns)
    ]
    lines = ["  ".join(name.ljust(w) for (name, _), w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    return "\n".join(lines)


def failures(rows: list[dict]) -> list[dict]:
    """Listed rows that spill, cannot launch or did not compile."""
    return [r for r in rows if r["listed"] and not candidates.passes(r)]


def _span(values: list) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def kernel_summary(rows: list[dict]) -> str:
    """One line per kernel and target over the listed configs that compiled: how many, registers,
    spill bytes, CTAs per SM and occupancy."""
    lines = ["per kernel (listed configs): rows, registers, spill bytes, CTAs per SM, occupancy"]
    order = {name: i for i, name in enumerate(KERNEL_ORDER)}
    done = [r for r in rows if r["listed"] and "error" not in r]
    for kernel, arch in sorted({(r["kernel"], r["arch"]) for r in done}, key=lambda k: (k[1], order[k[0]])):
        group = [r for r in done if (r["kernel"], r["arch"]) == (kernel, arch)]
        span = lambda key, g=group: _span([r[key] for r in g])
        occupancy = _span([round(100 * r["occupancy"]) for r in group])
        lines.append(
            f"  {kernel:<20} {arch}  {len(group):>3} rows  regs {span('registers'):<8} spill "
            f"{span('spill_bytes'):<4} CTA/SM {span('ctas_per_sm'):<5} occupancy {occupancy}%"
        )
    return "\n".join(lines)


def summary(rows: list[dict], seconds: float) -> str:
    listed = [r for r in rows if r["listed"]]
    ok = [r for r in listed if "error" not in r]
    lines = [
        f"{len(rows)} compilations ({len(listed)} listed configs) in {seconds:.0f} s; listed configs: "
        f"{sum(r['spill_bytes'] > 0 for r in ok)} spilling, {sum(not r['launchable'] for r in ok)} "
        f"unlaunchable, {len(listed) - len(ok)} failed to compile",
    ]
    wider = [r for r in rows if not r["listed"]]
    if wider:
        lines.append(
            f"wider candidates: {len(wider)} ({sum(not candidates.passes(r) for r in wider)} spill, cannot "
            "launch or do not compile)"
        )
    ref = [r for r in ok if (r["kernel"], r["arch"], r["case"], r["config"]) == REFERENCE_LOOP]
    for r in ref:
        lines.append(
            f"attention forward main loop, head dim 128, 128x128, 8 warps, 2 stages, sm_90 {r['dtype']}: "
            f"{r['loop_instructions']} instructions per warp per iteration"
        )
    for kernel in ("ln_bwd", "ln_bwd_residual"):
        for arch in sorted({r["arch"] for r in ok}):
            figures = [
                (r["width"], r["in_flight_bytes_per_sm"])
                for r in ok
                if r["kernel"] == kernel and r["arch"] == arch and r["dtype"] == ok[0]["dtype"]
            ]
            if figures:
                text = ", ".join(f"{w}: {_kib(b)}" for w, b in sorted(figures))
                lines.append(f"{kernel} {arch} {ok[0]['dtype']} in-flight KiB per SM by width: {text}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _head_dims(text: str) -> list[tuple[int, int]]:
    dims = []
    for item in filter(None, text.split(",")):  # "" selects no attention case
        d_qk, _, d_vo = item.partition("/")
        dims.append((int(d_qk), int(d_vo or d_qk)))
    return dims


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=_int_list, default=sorted(aot.TARGETS), help="80,90 (default)")
    parser.add_argument(
        "--dtype", type=lambda s: s.split(","), default=list(DTYPES), help="bf16,fp16 (default)"
    )
    parser.add_argument(
        "--head-dims",
        type=_head_dims,
        default=list(HEAD_DIMS),
        help="attention head widths, d or d_qk/d_vo, comma-separated (default: the model family's)",
    )
    parser.add_argument("--widths", type=_int_list, default=list(WIDTHS), help="layer-norm widths")
    parser.add_argument(
        "--lce-widths", type=_int_list, default=list(LCE_WIDTHS), help="linear cross-entropy hidden widths"
    )
    parser.add_argument(
        "--lce-variants",
        type=lambda s: s.split(","),
        default=list(LCE_VARIANTS),
        help="linear cross-entropy launches: train (gradients), train-bias (and a bias), eval (no gradients)",
    )
    parser.add_argument(
        "--masks", type=lambda s: s.split(","), default=list(MASKS), help="causal,full (default)"
    )
    parser.add_argument(
        "--loads",
        type=lambda s: s.split(","),
        default=list(LOADS),
        help="attention load paths: auto (the launchers' choice: TMA on sm_90), pointers (the cp.async "
        "path sm_90 takes for inputs TMA cannot address); default both",
    )
    parser.add_argument(
        "--attn-variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=list(ATTN_VARIANTS),
        help="attention variants: plain, gqa (4 query heads per key/value head), docs (packed "
        "documents), gqa-docs; default all",
    )
    parser.add_argument("--rms-widths", type=_int_list, default=list(RMS_WIDTHS), help="RMS-norm widths")
    parser.add_argument(
        "--rope-head-dims", type=_int_list, default=list(ROPE_HEAD_DIMS), help="rotary head widths"
    )
    parser.add_argument(
        "--glu-widths", type=_int_list, default=list(GLU_WIDTHS), help="gated-activation widths (d_ff)"
    )
    parser.add_argument("--json", metavar="FILE", help="write every row as JSON")
    parser.add_argument("--dump", metavar="DIR", help="write each cubin to DIR")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiler processes")
    parser.add_argument(
        "--candidates",
        action="store_true",
        help="also compile a wider set of tilings and print, per kernel, head-width class and target, "
        "those that pass in every case (tools/inspect/candidates.py)",
    )
    args = parser.parse_args(argv)
    for arch in args.arch:
        if arch not in aot.TARGETS:
            parser.error(f"--arch {arch}: known targets are {sorted(aot.TARGETS)}")
    for dtype in args.dtype:
        if dtype not in DTYPES:
            parser.error(f"--dtype {dtype}: choose from {', '.join(DTYPES)}")
    for mask in args.masks:
        if mask not in MASKS:
            parser.error(f"--masks {mask}: choose from {', '.join(MASKS)}")
    for loads in args.loads:
        if loads not in LOADS:
            parser.error(f"--loads {loads}: choose from {', '.join(LOADS)}")
    for variant in args.attn_variants:
        if variant not in ATTN_VARIANTS:
            parser.error(f"--attn-variants {variant}: choose from {', '.join(ATTN_VARIANTS)}")
    for variant in args.lce_variants:
        if variant not in LCE_VARIANTS:
            parser.error(f"--lce-variants {variant}: choose from {', '.join(LCE_VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(PROG, lambda: run(argv))


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    if runtime.interpreting():
        raise UsageError("the kernels were built for the Triton interpreter; run `python -m tools.inspect`")
    command = f"python -m {PROG} " + " ".join(argv)
    print(f"{PROG}: Triton {triton.__version__}, {datetime.date.today().isoformat()}")
    print(f"command: {command.strip()}")
    for arch in args.arch:
        t = aot.TARGETS[arch]
        print(
            f"target {t.name} ({t.gpu}): {t.sm_count} SMs, {t.smem_per_block // 1024} KiB shared memory "
            f"per CTA, {t.regs_per_sm} registers per SM"
        )
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cases = build_cases(args)
    tasks = build_tasks(cases, args.candidates, args.dump)
    print(f"{len(tasks)} compilations, {args.jobs} at a time", flush=True)
    rows = run_tasks(tasks, args.jobs)
    candidates_report = candidates.report(rows) if args.candidates else None  # in the sets' order
    order = {name: i for i, name in enumerate(KERNEL_ORDER)}
    rows.sort(
        key=lambda r: (
            r["arch"],
            r["dtype"],
            order.get(r["kernel"], 99),
            r["width"] or 0,
            r["case"],
            r["config"],
        )
    )
    seconds = time.perf_counter() - start
    print()
    print(format_rows(rows, show_listed=args.candidates))
    print()
    print(summary(rows, seconds))
    print(kernel_summary(rows))
    if candidates_report is not None:
        print(candidates_report)
    bad = failures(rows)
    if args.json:
        report = {
            "triton_version": triton.__version__,
            "date": datetime.date.today().isoformat(),
            "command": command.strip(),
            "targets": {aot.TARGETS[a].name: aot.TARGETS[a].gpu for a in args.arch},
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if bad:
        print(f"FAILED: {len(bad)} listed config(s) spill, cannot launch or do not compile:")
        for r in bad:
            why = r.get("error") or r.get("problem") or f"{r['spill_bytes']} B of spill traffic"
            print(f"  {' '.join(row_key(r))}: {why}")
        return 1
    print("OK: every listed config compiles without spills and launches")
    return 0
