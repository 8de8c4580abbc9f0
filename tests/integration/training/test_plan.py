"""lmsys-plan and the memory plan of real launches: the command's JSON and its errors, the refusal
before the engine exists, and real runs' measured and traced peaks beside the prediction. The
plan's components: tests/unit/training/test_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmsys.core.config import compose
from lmsys.training.devices import device_spec
from lmsys.training.planning import plan_launch
from tests.integration.features import COMMON, REPO_ROOT, SEQ, child_env, run_train


def _plan_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmsys.plan", *args],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_plan_command_json_and_errors():
    """One JSON object whose components add up to peak_bytes; bad input is one line, exit 2."""
    calls = {
        "json": _plan_cli(
            "model=gpt2_124m", "trainer=gpt2", "deepspeed=zero3", "world=8", "device=a100-80gb", "json=true"
        ),
        "text": _plan_cli("world=2"),
        "device": _plan_cli("device=tpu"),
        "world": _plan_cli("world=3"),
        "config": _plan_cli("model.d_model=-1"),
    }
    out = {name: (p.wait(timeout=120), *p.communicate()) for name, p in calls.items()}
    code, stdout, stderr = out["json"]
    assert code == 0, stderr
    plan = json.loads(stdout)
    for key in (
        "peak_bytes",
        "components",
        "device_bytes",
        "fits",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "suggestions",
    ):
        assert key in plan
    assert isinstance(plan["peak_bytes"], int) and sum(plan["components"].values()) == plan["peak_bytes"]
    assert plan["device_bytes"] == 80 * 2**30 and plan["fits"] is True and 0 < plan["mfu"] < 1
    code, stdout, _ = out["text"]
    assert code == 0 and "memory per rank:" in stdout and "fits:" in stdout
    for name, needle in (("device", "device='tpu'"), ("world", "world_size=3"), ("config", "model.d_model")):
        code, stdout, stderr = out[name]
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("lmsys-plan: error: "), stderr
        assert needle in lines[0]


def test_a_launch_predicted_not_to_fit_is_refused_before_the_engine(prepared_data, tmp_path):
    """A pretend device one byte smaller than the predicted peak: refused before any process
    group, engine or run directory exists, with the changes that fit (any lower peak does)."""
    overrides = [f"data.dir={prepared_data}", *COMMON, "trainer.plan=refuse"]
    peak = plan_launch(compose(overrides), 1, device_spec("cpu"), cpu_rate=1e9).peak_bytes
    run = run_train("refused", 1, [*overrides, f"trainer.plan_memory_bytes={peak - 1}"], tmp_path / "run")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("lmsys-train: error: predicted peak memory") and "what would fit" in lines[0]
    assert "trainer.plan=warn" in lines[0]
    assert "starting: process group" not in run.stdout and not (tmp_path / "run").exists()


def test_a_real_run_reports_its_measured_peak_beside_the_prediction(runs):
    """The cached 1-process run: the startup prediction, the measured peak after the first step
    (metrics.jsonl kind=memory) within a generous factor of the prediction (the bench's table
    holds the accuracy: docs/planning.md)."""
    run = runs.get("1proc").check()
    assert "memory: predicted" in run.stdout and "lmsys-plan lists the components" in run.stdout
    records = run.records("memory")  # one per launch of the cached run (a later test may resume it)
    assert records, run.stdout
    record = records[0]
    measured, predicted = record["measured_peak_bytes"], record["predicted_peak_bytes"]
    # after the second step: the first runs its forward and backward before Adam's state exists
    assert record["step"] == 2 and record["measured_by"] == "rss" and measured > 0
    assert 0.5 < measured / predicted < 2.0, (measured, predicted)
    assert f"measured {measured / 2**20:,.1f} MiB" in run.stdout


@pytest.mark.parametrize("stage, loss_impl", [(0, "full"), (2, "chunked")])
def test_a_traced_run_measures_the_tensors_the_plan_predicts(prepared_data, tmp_path, stage, loss_impl):
    """trainer.trace_memory=true: the peak of the tensors from torch's allocator events (not RSS,
    which glibc's retention moves), the ops at the peak named, within 10% of the plan's tensors."""
    overrides = [
        f"data.dir={prepared_data}",
        *COMMON,
        "model.d_model=128",
        "model.ffn.d_ff=512",
        "trainer.micro_batch_size=8",
        f"trainer.global_batch_tokens={16 * SEQ}",
        f"deepspeed=zero{stage}",
        f"model.loss_impl={loss_impl}",
    ]
    run = run_train(f"traced-{stage}", 1, [*overrides, "trainer.trace_memory=true"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-2000:]
    record = run.records("memory")[0]
    assert record["measured_by"] == "traced_tensors" and record["rank0_peak_during"], record
    holders = record["rank0_peak_holders"]  # the peak's blocks by allocating op: most of the peak
    assert 0.5 * record["measured_peak_bytes_per_rank"][0] < sum(holders.values()), holders
    plan = plan_launch(compose(overrides), 1, device_spec("cpu"), cpu_rate=1e9, suggest=False)
    assert record["predicted_peak_bytes"] == plan.tensor_bytes
    # the true peak lies in [measured - unseen frees, measured] (TracedPeak): within 10% of that
    measured, unseen = record["measured_peak_bytes"], record["measured_peak_unconfirmed_bytes"]
    assert (measured - unseen) * 0.9 <= plan.tensor_bytes <= measured * 1.1, (record, plan.components)
    assert "(tensors, traced)" in run.stdout


THREAD_FREED = """
import json, threading, torch
from lmsys.training.peak_memory import TensorPeak
mib = 2**20
trace = TensorPeak()
kept = torch.empty(2 * mib)  # 8 MiB
box = [torch.ones(mib)]  # 4 MiB, read once, its last reference then dropped by another thread
box[0].sum()
address = box[0].data_ptr()
dropper = threading.Thread(target=box.clear)
dropper.start()
dropper.join()
later = torch.empty(2 * mib)  # 8 MiB elsewhere, while the 4 MiB block's free is unknown
elsewhere = later.data_ptr() != address
del later
again = torch.empty(mib)  # 4 MiB at the same address (glibc's fixed mmap threshold: unmapped, mapped)
traced = trace.stop()
reused = again.data_ptr() == address
print(json.dumps([elsewhere, reused, traced.bytes / mib, traced.unconfirmed_bytes / mib]))
"""


def test_a_block_freed_on_another_thread_is_bounded_by_its_last_read_and_its_reuse():
    """A tensor whose last reference another thread drops (as gloo's workers do) is freed where
    the profiler cannot see it. It counts until its address comes back (not twice: 8 + 4 + 4),
    so the peak is 8 + 4 + 8 = 20 MiB; it was freed no earlier than the op that last read it, so
    the peak is at least 8 + 8 = 16 MiB, the true one: 4 MiB unconfirmed."""
    env = {**child_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}  # every 4 MiB block its own mapping
    script = [sys.executable, "-c", THREAD_FREED]
    out = subprocess.run(script, env=env, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    elsewhere, reused, peak_mib, unconfirmed_mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert elsewhere and reused, "the addresses did not fall as planned: the scenario did not happen"
    assert abs(peak_mib - 20) < 0.25 and abs(unconfirmed_mib - 4) < 0.25, (peak_mib, unconfirmed_mib)


def test_the_measured_peak_is_the_runs_own_not_its_launchers():
    """A run started by a large process (a notebook; this test session, 3 GB late in the suite):
    getrusage's ru_maxrss carries the launcher's peak across exec, VmHWM does not. The launcher
    here holds 600 MB; its child, which allocates nothing, must not report a peak near it."""
    child = "from lmsys.training.peak_memory import peak_rss_bytes; print(peak_rss_bytes())"
    launcher = (
        "import subprocess, sys\n"
        "held = bytearray(600 * 2**20)\n"
        "for i in range(0, len(held), 4096): held[i] = 1\n"
        f"done = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
        "print(done.stdout)"
    )
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 450 * 2**20, out.stdout  # torch's imports alone are ~300 MB
