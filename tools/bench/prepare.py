"""Preparation benchmark: lmsys-prepare's throughput against single-process SentencePiece, and its
peak memory for a corpus 1x and `scale`x as large.

    python -m tools.bench prepare                      # 16 MB corpus, then 4x (64 MB)
    python -m tools.bench prepare mb=4 scale=2 vocab=512

The corpus is the default corpus (Python stdlib docstrings, about 2 MB) repeated up to `mb`
megabytes, written as .jsonl files of at most 4 MB in a temporary directory. Each size is
prepared by the real CLI (`python -m lmsys.prepare` in a child process: tokenizer training on a
bounded sample of `sample_mb`, then encoding on `workers` threads). The baseline encodes the
same documents with one `SentencePieceProcessor.encode` call per document in this process,
with the tokenizer the 1x run trained (reading the files is not timed for the baseline; it is
for lmsys-prepare). The figure to report is the ratio (docs/DESIGN.md: every benchmark prints a
ratio against a baseline measured in the same run): prepare's encoding stage (reading,
encoding, splitting, writing shards) in MB/s over the baseline's MB/s; the end-to-end figure
(interpreter start, config, tokenizer training, pool start included) is printed beside it.

Memory is read from /proc while the child runs: the peak resident set (VmHWM) of the main
process, and the largest sampled sum of the resident sets of the whole
process tree. Bounded-memory streaming shows as a 4x/1x ratio near 1.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sentencepiece as spm

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import LmsysError, UsageError
from lmsys.data.corpus import DefaultCorpus, FileCorpus, module_docstrings

PROG = "tools.bench prepare"
OPTIONS = [
    Option("mb", "float", 16.0, "corpus size of the 1x run, MB"),
    Option("scale", "int", 4, "size of the memory run, in corpora"),
    Option("vocab", "int", 2048, "tokenizer vocabulary"),
    Option("workers", "int", 0, "encoding threads (0: all cores)"),
    Option("sample_mb", "float", 2.0, "tokenizer training sample, MB"),
    Option("keep", "str", None, "keep the corpora and prepared directories in this directory"),
]
FILE_BYTES = 4 << 20  # corpus files of at most this size


class PrepareFailed(LmsysError):
    """The lmsys-prepare run being measured failed."""

    exit_code = 1


def check_options(opts: dict[str, Any]) -> dict[str, Any]:
    if opts["mb"] is None or opts["sample_mb"] is None or opts["mb"] <= 0 or opts["sample_mb"] <= 0:
        raise UsageError("mb and sample_mb must be > 0")
    if opts["scale"] is None or opts["workers"] is None or opts["scale"] < 1 or opts["workers"] < 0:
        raise UsageError("scale must be >= 1 and workers >= 0")
    return opts


# ----------------------------------------------------------------------------- corpus


def write_corpus(directory: Path, target_bytes: int) -> int:
    """Stdlib docstrings repeated up to `target_bytes` of UTF-8, as .jsonl files; returns the bytes."""
    stdlib = DefaultCorpus()
    docs: list[str] = []
    have = 0
    for path in stdlib.files:  # parse only as much of the stdlib as the corpus needs
        doc = module_docstrings(path, stdlib.module_name(path))
        if doc:
            docs.append(doc)
            have += len(doc.encode("utf-8"))
            if have >= target_bytes:
                break
    directory.mkdir(parents=True, exist_ok=True)
    total, file_bytes, index, fh = 0, 0, 0, None
    try:
        while total < target_bytes:
            for doc in docs:
                if total >= target_bytes:
                    break
                doc = doc[: max(1, target_bytes - total)]  # the last document may be cut
                if fh is None or file_bytes >= FILE_BYTES:
                    if fh is not None:
                        fh.close()
                    fh = open(directory / f"part_{index:04d}.jsonl", "w", encoding="utf-8")
                    index, file_bytes = index + 1, 0
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                fh.write(line)
                file_bytes += len(line.encode("utf-8"))
                total += len(doc.encode("utf-8"))
    finally:
        if fh is not None:
            fh.close()
    return total


# ----------------------------------------------------------------------------- memory from /proc


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])  # the name may hold spaces: after ")"
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _status_kb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


class TreeMemory:
    """Samples the process tree under `pid` every `interval` s until stopped."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval = pid, interval
        self.hwm: dict[int, int] = {}  # pid -> peak resident kB seen
        self.peak_total = 0  # largest sum of VmRSS over the tree at one sample, kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            kids = _children_map()
            tree, todo = [], [self.pid]
            while todo:
                p = todo.pop()
                tree.append(p)
                todo.extend(kids.get(p, []))
            total = 0
            for p in tree:
                s = _status_kb(p)
                total += s.get("VmRSS", 0)
                self.hwm[p] = max(self.hwm.get(p, 0), s.get("VmHWM", 0))
            self.peak_total = max(self.peak_total, total)
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, float]:
        return {
            "main_mib": self.hwm.get(self.pid, 0) / 1024,
            "tree_mib": self.peak_total / 1024,
        }


# ----------------------------------------------------------------------------- runs


def run_prepare(corpus: Path, out: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """`python -m lmsys.prepare` on `corpus` in a child process; timings, memory and manifest."""
    cmd = [
        sys.executable, "-m", "lmsys.prepare",
        f"data.sources=[{corpus}]", f"data.dir={out}", f"model.vocab_size={opts['vocab']}",
        f"data.num_workers={opts['workers']}", f"data.tokenizer_sample_bytes={int(opts['sample_mb'] * 1e6)}",
        "data.overwrite=true",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
        ),
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with TreeMemory(proc.pid) as mem:
        stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise PrepareFailed(
            f"lmsys-prepare failed (exit {proc.returncode}): {stderr.strip() or stdout.strip()}"
        )
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "manifest": manifest, **mem.summary()}


def single_process_baseline(corpus: Path, tokenizer: Path) -> dict[str, float]:
    """One SentencePiece encode per document, in this process, on the same text."""
    docs = list(FileCorpus.from_sources([str(corpus)]).documents())
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for doc in docs:
        tokens += len(sp.encode(doc, out_type=int)) + 1  # + eos, as the packer writes
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": seconds, "cpu": cpu, "bytes": nbytes, "tokens": tokens, "mb_s": nbytes / 1e6 / seconds}


def run(opts: dict[str, Any]) -> dict[str, Any]:
    root_ctx = tempfile.TemporaryDirectory(prefix="tools-bench-prepare-") if not opts["keep"] else None
    root = Path(root_ctx.name if root_ctx else opts["keep"])
    try:
        sizes = [1] + ([opts["scale"]] if opts["scale"] > 1 else [])
        runs: dict[int, dict[str, Any]] = {}
        baseline: dict[str, float] = {}
        for k in sizes:
            corpus, out = root / f"corpus_{k}x", root / f"prepared_{k}x"
            shutil.rmtree(corpus, ignore_errors=True)
            nbytes = write_corpus(corpus, int(opts["mb"] * 1e6 * k))
            r = run_prepare(corpus, out, opts)
            r["bytes"] = nbytes
            runs[k] = r
            if k == 1:  # right after its prepare run, so both see the same machine load
                baseline = single_process_baseline(corpus, out / "tokenizer.model")
        return {"opts": opts, "runs": runs, "baseline": baseline}
    finally:
        if root_ctx is not None:
            root_ctx.cleanup()


def report(result: dict[str, Any]) -> str:
    opts, runs, base = result["opts"], result["runs"], result["baseline"]
    one = runs[1]
    m = one["manifest"]
    enc = m["encoding"]
    text_mb = m["documents"]["text_bytes"] / 1e6
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    same = "same" if tokens == base["tokens"] else f"DIFFERENT ({base['tokens']:,})"
    enc_mb_s = text_mb / enc["seconds"]
    cpu_main, cpu_total = enc["cpu_seconds"]["main"], enc["cpu_seconds"]["total"]
    n = int(enc["workers"])
    # n encoding threads and the main thread share n cores: wall >= max(main, total / n).
    bound = base["cpu"] / max(cpu_main, cpu_total / n)
    load = "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    e2e_mb_s = text_mb / one["seconds"]
    cpu = platform.processor() or platform.machine()
    ratio, e2e_ratio = enc_mb_s / base["mb_s"], e2e_mb_s / base["mb_s"]
    mem_header = f"{'peak memory (MiB)':<20}{'corpus MB':>10}{'main':>10}{'all procs':>11}"
    lines = [
        f"{PROG}: corpus {text_mb:.1f} MB (stdlib docstrings, .jsonl), vocab {opts['vocab']}, "
        f"{enc['workers']} workers, {os.cpu_count()} cores ({cpu}), {load}",
        f"tokens: {tokens:,} ({same} as the baseline)",
        "",
        f"{'encoder':<40}{'seconds':>10}{'MB/s':>10}{'CPU s':>10}",
        f"{'single-process sentencepiece (baseline)':<40}{base['seconds']:>10.2f}{base['mb_s']:>10.2f}"
        f"{base['cpu']:>10.2f}",
        f"{'lmsys-prepare, encoding stage':<40}{enc['seconds']:>10.2f}{enc_mb_s:>10.2f}{cpu_total:>10.2f}",
        f"{'lmsys-prepare, end to end':<40}{one['seconds']:>10.2f}{e2e_mb_s:>10.2f}",
        f"ratio prepare/single: {ratio:.2f}x (end to end {e2e_ratio:.2f}x)",
        f"CPU: encoding took {cpu_total:.2f} s, {cpu_main:.2f} s of it in the main thread "
        f"({base['cpu'] / cpu_total:.0%} of the baseline's efficiency); on {n} idle cores at most "
        f"{bound:.2f}x (wall-clock ratios depend on the machine's load)",
        "",
        mem_header + f"{'seconds':>10}",
    ]
    for k, r in runs.items():
        mb = r["manifest"]["documents"]["text_bytes"] / 1e6
        lines.append(
            f"{f'{k}x':<20}{mb:>10.1f}{r['main_mib']:>10.0f}{r['tree_mib']:>11.0f}{r['seconds']:>10.1f}"
        )
    if len(runs) > 1:
        k = max(runs)
        lines.append(
            f"ratio memory {k}x/1x: all processes {runs[k]['tree_mib'] / max(one['tree_mib'], 1e-9):.2f}, "
            f"main {runs[k]['main_mib'] / max(one['main_mib'], 1e-9):.2f} (corpus {k}x larger)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, __doc__ or PROG)
        if opts is None:
            return 0
        print(report(run(check_options(opts))), flush=True)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
