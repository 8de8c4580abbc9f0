"""lmsys-plan and the plan of real launches: the command's JSON, check=true and errors, the refusal
before the engine exists, a real run's measured peak beside the prediction, a model's export
planned as the export's model, and the measurement's bounds (a block freed on another thread, the
run's own peak RSS). In-process: tests/unit/training/test_plan.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from lmsys.core.config import compose
from lmsys.core.devices import device_spec
from lmsys.interop.export_dir import write_export
from lmsys.model.transformer import Transformer
from lmsys.planning.planner import plan_launch
from tests.integration.features import COMMON, REPO_ROOT, child_env, run_train

SMALL = [o for o in COMMON if o.startswith("model.")] + [
    "trainer.global_batch_tokens=256",
    "trainer.micro_batch_size=4",
]


def _plan(overrides: list[str], world: int = 1, device: str = "cpu", memory: int = 0):
    return plan_launch(compose([*SMALL, *overrides]), world, device_spec(device, memory))


def test_a_models_export_is_planned_as_the_exports_model(prepared_data, tmp_path):
    """model.init_from=EXPORT: the plan of the export's model (here wider than the config's)."""
    cfg = compose([*COMMON, "model.d_model=48", "model.n_heads=3"])
    model = Transformer(cfg.model)
    export = write_export(
        tmp_path / "export", cfg.model, model.state_dict(), prepared_data / "tokenizer.model"
    )
    plan = plan_launch(
        compose([f"model.init_from={export}", "trainer.global_batch_tokens=256"]), 1, device_spec("cpu")
    )
    assert plan.n_params == model.num_parameters() != _plan([]).n_params


def _plan_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmsys.plan", *args],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_plan_command_json_check_and_errors():
    """One JSON object whose components add up to peak_bytes; check=true exits 3 for a launch that
    does not fit (device_memory=: another card); bad input is one line, exit 2."""
    calls = {
        "json": _plan_cli(
            "model=gpt2_124m", "trainer=gpt2", "deepspeed=zero3", "world=8", "device=a100-80gb", "json=true"
        ),  # fmt: skip
        "check": _plan_cli(
            "model=gpt2_124m", "trainer=gpt2", "device=rtx4090", "device_memory=1000000", "check=true"
        ),  # fmt: skip
        "given": _plan_cli("trainer.plan_memory_bytes=1000", "check=true"),  # as lmsys-train takes it
        "text": _plan_cli("world=2"),
        "device": _plan_cli("device=tpu"),
        "world": _plan_cli("world=3"),
        "memory": _plan_cli("device_memory=lots"),
        "config": _plan_cli("model.d_model=-1"),
    }
    out = {name: (p.wait(timeout=300), *p.communicate()) for name, p in calls.items()}
    code, stdout, stderr = out["json"]
    assert code == 0, stderr
    plan = json.loads(stdout)
    assert isinstance(plan["peak_bytes"], int) and sum(plan["components"].values()) == plan["peak_bytes"]
    assert plan["device_bytes"] == int(79.25 * 2**30) and plan["fits"] is True and 0 < plan["mfu"] < 1
    code, stdout, stderr = out["check"]
    assert code == 3 and "does NOT fit" in stdout and "what lowers the peak" in stdout, stderr
    code, stdout, stderr = out["given"]
    assert code == 3 and "does NOT fit" in stdout, stderr
    code, stdout, _ = out["text"]
    assert code == 0 and "memory per rank" in stdout and "no time on a CPU" in stdout
    for name, needle in (
        ("device", "device='tpu'"), ("world", "world_size=3"), ("memory", "device_memory='lots'"),
        ("config", "model.d_model"),
    ):  # fmt: skip
        code, stdout, stderr = out[name]
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("lmsys-plan: error: "), stderr
        assert needle in lines[0]


def test_a_launch_predicted_not_to_fit_is_refused_before_the_engine(prepared_data, tmp_path):
    """A pretend device one byte smaller than the predicted peak: refused before any process
    group, engine or run directory exists, with the changes that fit."""
    overrides = [f"data.dir={prepared_data}", *COMMON, "trainer.plan=refuse"]
    peak = plan_launch(compose(overrides), 1, device_spec("cpu")).peak_bytes
    run = run_train("refused", 1, [*overrides, f"trainer.plan_memory_bytes={peak - 1}"], tmp_path / "run")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("lmsys-train: error: predicted peak memory") and "what would fit" in lines[0]
    assert "trainer.plan=warn" in lines[0]
    assert "starting: process group" not in run.stdout and not (tmp_path / "run").exists()


def test_a_real_run_reports_its_measured_peak_beside_the_prediction(runs):
    """The cached 1-process run: the startup prediction, then after the second step its peak RSS
    beside the prediction, as a bound and not as the planner's error (no percentage)."""
    run = runs.get("1proc").check()
    assert "memory: predicted" in run.stdout and "lmsys-plan lists the components" in run.stdout
    record = run.records("memory")[0]
    assert record["step"] == 2 and record["measured_by"] == "rss" and record["measured_peak_bytes"] > 0
    line = next(line for line in run.stdout.splitlines() if "peak RSS grew by" in line)
    assert "not the planner's error" in line and "%" not in line


THREAD_FREED = """
import json, threading, torch
from tools.bench.plan.tensor_trace import TensorPeak
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
peak, unseen = trace.stop()
print(json.dumps([elsewhere, again.data_ptr() == address, peak / mib, unseen / mib]))
"""


def test_a_block_freed_on_another_thread_is_bounded_by_its_last_read_and_its_reuse():
    """A tensor whose last reference another thread drops (as gloo's workers do) is freed where
    the profiler cannot see it: it counts until its address comes back (8 + 4 + 8 = 20 MiB), and
    it was freed no earlier than the op that last read it (8 + 8 = 16 MiB, the true peak)."""
    env = {**child_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}  # every 4 MiB block its own mapping
    out = subprocess.run([sys.executable, "-c", THREAD_FREED], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT)  # fmt: skip
    elsewhere, reused, peak_mib, unseen_mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert elsewhere and reused, "the addresses did not fall as planned: the scenario did not happen"
    assert math.isclose(peak_mib, 20, abs_tol=0.25) and math.isclose(unseen_mib, 4, abs_tol=0.25)


def test_the_measured_peak_is_the_runs_own_not_its_launchers():
    """A run started by a large process (a notebook; this test session): getrusage's ru_maxrss
    carries the launcher's peak across exec, VmHWM does not."""
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
