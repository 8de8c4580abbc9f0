"""The kernel self-check in real training runs (1 process, the Triton CPU interpreter): a kernel
broken on purpose (debug.break_kernel) falls back to torch with one warning under
model.kernels=auto (the fused loss, the one kernel a CPU run under auto uses) and the run trains;
under model.kernels=triton it is one error line, exit 1, before any step."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.features import Run, child_env, train_command

pytestmark = pytest.mark.slow


def test_a_broken_kernel_falls_back_under_auto_and_stops_the_run_under_triton(runs, tmp_path):
    base = [*runs.overrides("1proc"), "trainer.max_steps=2", "model.loss_impl=fused"]
    cases = {
        "auto": [*base, "debug.break_kernel=linear_cross_entropy"],
        "triton": [*base, "model.kernels=triton", "debug.break_kernel=attention"],
    }
    started = {
        name: subprocess.Popen(
            train_command(1, [*overrides, f"trainer.run_dir={tmp_path / name}"]),
            cwd=tmp_path,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, overrides in cases.items()
    }
    done = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=400)
        done[name] = Run(name, tmp_path / name, proc.returncode, out, err)

    auto = done["auto"].check()
    warnings = [ln for ln in auto.stderr.splitlines() if "kernel self-check" in ln]
    assert warnings == [
        "lmsys-train: warning: kernel self-check: the Triton kernel linear_cross_entropy on cpu (float32): "
        "forward output differs by 1 (tolerance 0.0001 of the largest value); it falls back to its torch "
        "reference for this run"
    ], auto.stderr
    line = "lmsys-train: kernel self-check on cpu at float32: linear_cross_entropy fell back to torch ("
    assert line in auto.stdout, auto.stdout
    assert sorted(auto.losses()) == [1, 2]

    triton = done["triton"]
    assert triton.returncode == 1, triton.stdout + triton.stderr
    lines = [ln for ln in triton.stderr.splitlines() if ln.startswith("lmsys-train: error:")]
    assert lines == [
        "lmsys-train: error: kernel self-check failed: the Triton kernel attention on cpu (float32): forward "
        "output differs by 1 (tolerance 0.0001 of the largest value); model.kernels=auto falls back to torch "
        "for it, model.kernels=torch uses torch everywhere"
    ], triton.stderr
    assert "Traceback" not in triton.stderr
    assert not (tmp_path / "triton" / "checkpoints").exists()


def test_a_passing_check_is_a_startup_line(runs):
    """The cached fused-loss run: the kernel it uses passed, in one timed startup line."""
    run = runs.get("1proc-fused").check()
    line = "lmsys-train: kernel self-check on cpu at float32: linear_cross_entropy match torch (forward"
    assert f"{line} and backward) (" in run.stdout, run.stdout
