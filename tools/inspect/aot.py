"""Ahead-of-time compilation of the Triton kernels for NVIDIA GPUs, and what the binaries say.

No GPU is needed: Triton compiles any `@triton.jit` function for a given target on a CPU, and the
wheel bundles ptxas, nvdisasm and cuobjdump. A kernel is compiled exactly as the JIT would compile
it on the device: the real launch arguments go through the JIT's own binder, so the signature,
the constexprs and the divisibility specialisation (pointers 16-byte aligned, ints divisible by
16, unit strides folded to constants) are the ones a launch would produce.

    binary = compile_for_target(kernel, args, kwargs, SM90)   # kwargs: constexprs, num_warps, ...
    report = analyse(binary, SM90)                            # registers, spills, occupancy, SASS

Everything here is static: register and shared-memory use, spills, theoretical occupancy, which
instructions the compiler chose (wgmma or mma.sync, TMA or cp.async) and how many instructions
the main loop executes per iteration. None of it is a timing.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kernels.runtime import DeviceLimits

# ptxas, nvdisasm and cuobjdump as shipped inside the triton wheel.
NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass(frozen=True)
class Target:
    """Per-SM limits of one GPU (CUDA occupancy calculator figures for its compute capability)."""

    name: str  # "sm_90"
    gpu: str  # the board the SM count and bandwidth are for
    capability: int  # 90 for compute capability 9.0
    sm_count: int
    smem_per_sm: int  # bytes of shared memory per SM
    smem_per_block: int  # bytes one CTA may use (the opt-in maximum)
    hbm_bytes_per_s: float  # peak memory bandwidth, for the in-flight bytes Little's law asks for
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256
    reg_subpartitions: int = 4  # the register file is split over 4 schedulers; a warp lives in one
    smem_reserved_per_block: int = 1024  # the runtime reserves 1 KiB per CTA (sm_80 and later)
    smem_alloc_unit: int = 128
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    memory_latency_ns: float = 600.0  # unloaded DRAM latency, order of magnitude

    @property
    def limits(self) -> DeviceLimits:
        """What a launch may use on this target, as the runtime reads it off a device."""
        return DeviceLimits(self.capability, self.sm_count, self.smem_per_block, self.max_threads_per_block)

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    @property
    def little_bytes_per_sm(self) -> float:
        """Bytes that must be in flight per SM to cover the latency at peak bandwidth (Little's law)."""
        return self.hbm_bytes_per_s * self.memory_latency_ns * 1e-9 / self.sm_count


SM80 = Target(
    "sm_80", "A100 SXM 80GB", 80, sm_count=108, smem_per_sm=164 * 1024, smem_per_block=163 * 1024,
    hbm_bytes_per_s=2.039e12,
)  # fmt: skip
SM90 = Target(
    "sm_90", "H100 SXM", 90, sm_count=132, smem_per_sm=228 * 1024, smem_per_block=227 * 1024,
    hbm_bytes_per_s=3.35e12,
)  # fmt: skip
TARGETS: dict[int, Target] = {t.capability: t for t in (SM80, SM90)}


# ----------------------------------------------------------------------------------------------
# Compilation
# ----------------------------------------------------------------------------------------------


@dataclass
class Binary:
    """One compiled kernel: the cubin and what the compiler said about it."""

    name: str  # the kernel's function name
    cubin: bytes
    ptx: str
    ptxas_log: str  # ptxas -v output: registers, spills, stack frame
    shared_bytes: int  # dynamic shared memory per CTA
    num_warps: int
    num_stages: int
    compile_seconds: float


def jit_function(kernel) -> JITFunction:
    """The @triton.jit function under triton.autotune / triton.heuristics wrappers."""
    while not isinstance(kernel, JITFunction):
        if not hasattr(kernel, "fn"):
            raise TypeError(
                f"{kernel!r} is not a compilable @triton.jit function (was TRITON_INTERPRET=1 set "
                "before triton was imported? Compiling for a GPU needs it unset)"
            )
        kernel = kernel.fn
    return kernel


def compile_for_target(kernel, args: Sequence, kwargs: dict, target: Target) -> Binary:
    """Compile `kernel(*args, **kwargs)` for `target` the way `kernel[grid](*args, **kwargs)` would
    on such a device. kwargs hold the constexprs and the options (num_warps, num_stages).

    Tensors may live on any device (CPU or meta): only their dtype, and the alignment of their
    data pointers, enter the compilation. Nothing is cached: every call runs the whole compiler.
    """
    fn = jit_function(kernel)
    backend = make_backend(target.gpu_target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    # The options JITFunction.run adds before binding.
    kwargs = {
        "debug": bool(fn.debug) or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
        "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts,
        **kwargs,
    }
    log = io.StringIO()
    start = time.perf_counter()
    with (
        knobs.nvidia.scope(),
        knobs.compilation.scope(),
        contextlib.redirect_stdout(log),
        warnings.catch_warnings(),
    ):
        # Triton 3.9 warns that its fp-fusion default will change; the JIT's default applies here.
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v output
        knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target.gpu_target, options=options.__dict__
        )
    seconds = time.perf_counter() - start
    return Binary(
        name=compiled.metadata.name,
        cubin=compiled.asm["cubin"],
        ptx=compiled.asm["ptx"],
        ptxas_log=log.getvalue(),
        shared_bytes=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
        num_stages=int(compiled.metadata.num_stages),
        compile_seconds=seconds,
    )


# ----------------------------------------------------------------------------------------------
# ptxas resource usage and occupancy
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PtxasUsage:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def parse_ptxas_log(log: str) -> PtxasUsage:
    """Registers, spills and stack frame of the (only) entry function in a `ptxas -v` log."""

    def number(pattern: str) -> int:
        found = re.findall(pattern, log)
        if len(found) != 1:
            raise ValueError(f"expected one match of {pattern!r} in the ptxas log, got {len(found)}:\n{log}")
        return int(found[0])

    return PtxasUsage(
        registers=number(r"Used (\d+) registers"),
        spill_store_bytes=number(r"(\d+) bytes spill stores"),
        spill_load_bytes=number(r"(\d+) bytes spill loads"),
        stack_bytes=number(r"(\d+) bytes stack frame"),
    )


def cuobjdump_resource_usage(cubin_path: str | Path) -> dict[str, int]:
    """`cuobjdump -res-usage` of a cubin with one kernel: {"REG": .., "STACK": .., "SHARED": .., ...}."""
    out = subprocess.run(
        [str(NVIDIA_TOOLS / "cuobjdump"), "-res-usage", str(cubin_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int  # 0: the kernel cannot launch on this target
    warps_per_sm: int
    fraction: float  # resident warps / the SM's maximum
    limiters: tuple[str, ...]  # the resources that bound ctas_per_sm: registers, smem, warps, blocks
    launchable: bool
    problem: str  # why it cannot launch ("" when it can)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(target: Target, registers: int, shared_bytes: int, num_warps: int) -> Occupancy:
    """Theoretical CTAs per SM, as the CUDA occupancy calculator computes them, and whether one CTA
    fits at all (registers, shared memory and threads within the per-block limits)."""
    problems = []
    regs_per_warp = _round_up(registers * 32, target.reg_alloc_unit)
    if registers > target.max_regs_per_thread:
        problems.append(f"{registers} registers per thread > {target.max_regs_per_thread}")
    if regs_per_warp * num_warps > target.regs_per_block:
        problems.append(f"{regs_per_warp * num_warps} registers per CTA > {target.regs_per_block}")
    if shared_bytes > target.smem_per_block:
        problems.append(f"{shared_bytes} B shared memory > {target.smem_per_block} B per CTA")
    if num_warps * 32 > target.max_threads_per_block:
        problems.append(f"{num_warps * 32} threads > {target.max_threads_per_block}")
    if problems:
        return Occupancy(0, 0, 0.0, (), False, "; ".join(problems))
    # A warp's registers come from one of the sub-partitions' register files.
    warps_by_regs = (
        target.regs_per_sm // target.reg_subpartitions // regs_per_warp
    ) * target.reg_subpartitions
    smem_per_cta = _round_up(shared_bytes + target.smem_reserved_per_block, target.smem_alloc_unit)
    limits = {
        "registers": warps_by_regs // num_warps,
        "smem": target.smem_per_sm // smem_per_cta,
        "warps": target.max_warps_per_sm // num_warps,
        "blocks": target.max_blocks_per_sm,
    }
    ctas = min(limits.values())
    limiters = tuple(name for name, value in limits.items() if value == ctas)
    return Occupancy(
        ctas, ctas * num_warps, ctas * num_warps / target.max_warps_per_sm, limiters, ctas > 0, ""
    )


# ----------------------------------------------------------------------------------------------
# SASS
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # "HGMMA", "LDG", ...
    modifiers: str  # ".64x128x16.F32.BF16", ".E.128", ...
    operands: str


# "/*0a70*/  @!P0 LDG.E.128 R4, desc[UR6][R2.64] ;"
_SASS_LINE = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)([^;]*);"
)
_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")


@dataclass
class Sass:
    instructions: list[Instruction]
    labels: dict[str, int] = field(default_factory=dict)  # label -> address of the next instruction


def disassemble(cubin: bytes) -> Sass:
    """nvdisasm the cubin into instructions and branch labels."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(NVIDIA_TOOLS / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    sass = Sass([])
    pending: list[str] = []
    for line in text.splitlines():
        if label := _LABEL.match(line.strip()):
            pending.append(label[1])
            continue
        if m := _SASS_LINE.search(line):
            ins = Instruction(int(m[1], 16), m[2], m[3], m[4].strip())
            sass.instructions.append(ins)
            for name in pending:
                sass.labels[name] = ins.address
            pending = []
    return sass


def innermost_loops(sass: Sass) -> list[list[Instruction]]:
    """Loop bodies found by back edges (a branch to an earlier address), keeping only those that
    contain no other loop. Spin-waits on barriers (a few instructions) and the jumps back from
    out-of-line blocks placed after EXIT are not loops of the kernel and are left out."""
    spans = []
    for ins in sass.instructions:
        if ins.opcode != "BRA":
            continue
        target = re.search(r"(\.L_x_\d+)", ins.operands)
        if target and sass.labels.get(target[1], ins.address + 1) <= ins.address:
            spans.append((sass.labels[target[1]], ins.address))
    exits = [ins.address for ins in sass.instructions if ins.opcode == "EXIT"]
    spans = [
        (lo, hi)
        for lo, hi in spans
        if (hi - lo) // 16 >= 8 and not any(lo <= e <= hi for e in exits)  # 16 bytes per instruction
    ]
    innermost = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [
        [ins for ins in sass.instructions if lo <= ins.address <= hi] for lo, hi in sorted(set(innermost))
    ]


MMA_OPCODES = {"HGMMA": "wgmma", "HMMA": "mma.sync"}


def mma_kind(instructions: Sequence[Instruction]) -> str:
    """ "wgmma" (Hopper warpgroup MMA), "mma.sync" (Ampere-style warp MMA) or "none" (FMA dots)."""
    for opcode, kind in MMA_OPCODES.items():
        if any(ins.opcode == opcode for ins in instructions):
            return kind
    return "none"


def global_load_paths(instructions: Sequence[Instruction]) -> list[str]:
    """How the kernel reads global memory: "tma" (UTMALDG, bulk tensor copies), "cp.async"
    (LDGSTS, asynchronous copies to shared memory), "ldg" (loads to registers)."""
    opcodes = {ins.opcode for ins in instructions}
    paths = [("tma", "UTMALDG"), ("cp.async", "LDGSTS"), ("ldg", "LDG")]
    return [name for name, opcode in paths if opcode in opcodes]


def main_loop(loops: list[list[Instruction]]) -> list[Instruction] | None:
    """The steady-state loop: among loops with tensor-core instructions, the shortest (the body
    without masks; masked bodies run only on the diagonal and the tail), else the longest loop."""
    mma_loops = [body for body in loops if mma_kind(body) != "none"]
    if mma_loops:
        return min(mma_loops, key=len)
    return max(loops, key=len, default=None)


def _load_width_bytes(modifiers: str) -> int:
    """Bytes per thread of one LDG: LDG.E.128 = 16, .64 = 8, .U16 = 2, plain = 4."""
    mods = modifiers.split(".")
    for token, width in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if token in mods:
            return width
    return 4


def ldg_bytes(instructions: Sequence[Instruction], num_warps: int) -> int:
    """Bytes one CTA requests with the per-thread global loads (LDG, and LDGSTS: cp.async) among
    `instructions`, each executed once by every thread. TMA copies are not counted (their size
    lives in the descriptor, not in the instruction)."""
    per_thread = sum(
        _load_width_bytes(ins.modifiers) for ins in instructions if ins.opcode in ("LDG", "LDGSTS")
    )
    return per_thread * 32 * num_warps


# ----------------------------------------------------------------------------------------------
# One report row
# ----------------------------------------------------------------------------------------------


@dataclass
class Analysis:
    usage: PtxasUsage
    occupancy: Occupancy
    shared_bytes: int
    num_warps: int
    num_stages: int
    mma: str
    load_paths: list[str]
    loop_instructions: int | None  # SASS instructions per warp in one iteration of the main loop
    loop_ldg_bytes: (
        int | None
    )  # bytes one CTA loads with LDG per main-loop iteration (whole kernel if loopless)
    compile_seconds: float

    @property
    def in_flight_bytes_per_sm(self) -> int | None:
        """Bytes of loads a full SM has outstanding when every resident CTA issued one iteration."""
        if self.loop_ldg_bytes is None:
            return None
        return self.loop_ldg_bytes * self.occupancy.ctas_per_sm


def analyse(binary: Binary, target: Target) -> Analysis:
    usage = parse_ptxas_log(binary.ptxas_log)
    sass = disassemble(binary.cubin)
    loop = main_loop(innermost_loops(sass))
    return Analysis(
        usage=usage,
        occupancy=occupancy(target, usage.registers, binary.shared_bytes, binary.num_warps),
        shared_bytes=binary.shared_bytes,
        num_warps=binary.num_warps,
        num_stages=binary.num_stages,
        mma=mma_kind(sass.instructions),
        load_paths=global_load_paths(sass.instructions),
        loop_instructions=len(loop) if loop is not None else None,
        loop_ldg_bytes=ldg_bytes(loop if loop is not None else sass.instructions, binary.num_warps),
        compile_seconds=binary.compile_seconds,
    )
