"""A step that goes wrong, with real runs (DeepSpeed ZeRO-2, 2 ranks where the rank matters):

- NaNs injected at a chosen module, pass, rank, step and micro-batch (debug.nonfinite_at)
  are named exactly in <run>/diagnostics/nonfinite-step-N.json and in one line, with the data the
  micro-batch came from; a weight made NaN is named too, and the checkpoint after it is refused;
- a real finite divergence (optim.lr=1) is reported with its largest-gradient modules, and with
  trainer.on_nonfinite=stop the run exits 1;
- trainer.on_nonfinite=rewind goes back to the last checkpoint, skips the step's data and
  finishes; a resume from a checkpoint older than the rewind skips the same data (its losses are
  the rewound run's, bitwise);
- a replay that runs out of memory (a real allocation refused: debug.replay_oom) is
  reported, the run goes on; at ZeRO-3 a rank that cannot allocate its copy leaves no rank waiting
  in the gather.

The four first runs start together (their start-up overlaps), the resume after the rewind.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from lmsys.data.loader import TokenLoader
from lmsys.data.shards import PreparedData
from tests.integration.features import Run, child_env, run_train, train_command

pytestmark = pytest.mark.slow

TWO_RANKS = ["deepspeed=zero2", "trainer.micro_batch_size=2"]  # 2 micro-batches per rank and step
KEYS = {"step", "rank", "micro_batch", "module", "pass", "data"}


def _launch(runs, root, name: str, nproc: int, extra: list[str]) -> tuple[subprocess.Popen, Run]:
    run_dir = root / name
    overrides = [*runs.overrides("1proc"), "logger=none", *extra, f"trainer.run_dir={run_dir}"]
    with open(root / f"{name}.out", "w") as out, open(root / f"{name}.err", "w") as err:  # no pipe to fill
        proc = subprocess.Popen(
            train_command(nproc, overrides), cwd=root, env=child_env(), stdout=out, stderr=err
        )
    return proc, Run(name, run_dir, 0, "", "", overrides)


@pytest.fixture(scope="module")
def bad_runs(runs, tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("nonfinite")
    launches = {
        "injected": _launch(runs, root, "injected", 2, [
            *TWO_RANKS,
            "debug.nonfinite_at=[blocks.1.attn:backward:rank1:step3:micro1,"
            "blocks.0.ffn.out:weights:rank0:step5]",
        ]),
        "diverged": _launch(runs, root, "diverged", 1, ["optim.lr=1", "trainer.on_nonfinite=stop"]),
        "rewound": _launch(runs, root, "rewound", 2, [
            *TWO_RANKS, "trainer.on_nonfinite=rewind",
            "debug.nonfinite_at=[blocks.1.ffn:forward:rank0:step4]",
        ]),
        "short_of_memory": _launch(runs, root, "short_of_memory", 2, [
            "deepspeed=zero3", "trainer.micro_batch_size=2", "trainer.max_steps=5",
            "debug.nonfinite_at=[blocks.1.attn:backward:rank0:step2,blocks.0.ffn:forward:rank1:step4]",
            "debug.replay_oom=[copy:rank1:step2,replay:rank0:step4]",
        ]),
    }  # fmt: skip
    done = {}
    for name, (proc, run) in launches.items():
        proc.wait(timeout=600)
        out, err = ((root / f"{name}.{kind}").read_text() for kind in ("out", "err"))
        done[name] = Run(name, run.run_dir, proc.returncode, out, err, run.overrides)
    return done


def report(run: Run, name: str) -> dict:
    data = json.loads((run.run_dir / "diagnostics" / name).read_text())
    assert KEYS <= set(data), sorted(data)
    return data


def test_an_injected_nan_is_named_by_module_pass_rank_and_micro_batch(bad_runs, runs):
    run = bad_runs["injected"]
    nan = report(run, "nonfinite-step-3.json")
    assert (nan["step"], nan["rank"], nan["micro_batch"]) == (3, 1, 1), nan
    assert (nan["module"], nan["pass"], nan["tensor"]) == ("blocks.1.attn", "backward", "input gradient")
    assert [f["rank"] for f in nan["findings"]] == [1]  # rank 0 replayed its share clean
    line = f"lmsys-train: step 3: gradient is non-finite; first non-finite in blocks.1.attn (backward) on rank 1, micro-batch 1; report: {run.run_dir}/diagnostics/nonfinite-step-3.json"  # noqa: E501
    assert line in run.stdout.splitlines(), run.stdout
    assert (
        "warning: step 3: gradient is non-finite; skipped the update (1 of trainer.max_nan_skips=5)"
        in run.stderr
    )
    # the data: rank 1's second micro-batch of stream step 2, as the loader cuts it
    (entry,) = nan["data"]
    assert (entry["rank"], entry["micro_batch"], nan["data_step"]) == (1, 1, 2)
    loader = TokenLoader(PreparedData(runs.data_dir), "train", tokens_per_sample=33, global_batch_size=8,
                         micro_batch_size=2, rank=1, world_size=2, seed=1337)  # fmt: skip
    assert [s["sample"] for s in entry["sequences"]] == loader.sample_indices(2, 1).tolist()
    assert {s["shard"] for s in entry["sequences"]} == {"train_0000.bin"}
    assert all(s["shard_offset"] == s["split_offset"] == 33 * s["sample"] for s in entry["sequences"])
    assert "OVERFLOW" not in run.stdout + run.stderr  # DeepSpeed's notice would double the report

    # a NaN weight after step 5 (rank 0): named at step 6, whose checkpoint is refused
    weight = report(run, "nonfinite-step-6.json")
    assert (weight["rank"], weight["micro_batch"], weight["module"], weight["pass"]) == (
        0,
        0,
        "blocks.0.ffn.out",
        "forward",
    )
    assert weight["tensor"] == "weight blocks.0.ffn.out.weight" and weight["loss"] == "nan"
    assert run.returncode == 1, run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("lmsys-train: error: ")]
    assert errors == [
        "lmsys-train: error: refusing to save the checkpoint of step 6: weight blocks.0.ffn.out.weight holds "
        f"NaN/inf (rank 0); the last intact checkpoint stays the newest in {run.run_dir}/checkpoints"
    ], run.stderr
    assert sorted(p.name for p in (run.run_dir / "checkpoints").glob("step_*")) == [
        "step_0000002",
        "step_0000004",
    ]


def test_a_finite_divergence_is_reported_and_stops_the_run(bad_runs):
    run = bad_runs["diverged"]
    assert run.returncode == 1, run.stdout + run.stderr
    (path,) = (run.run_dir / "diagnostics").glob("divergence-step-*.json")
    rep = report(run, path.name)
    ceiling = math.log(512) + 1.0
    assert rep["kind"] == "diverging" and rep["loss"] > ceiling and rep["policy"] == "stop"
    assert rep["grad_norm"] > 0 and len(rep["largest_gradients"]) == 5
    norms = [g["grad_norm"] for g in rep["largest_gradients"]]
    assert norms == sorted(norms, reverse=True) and rep["module"] == rep["largest_gradients"][0]["module"]
    assert {d["micro_batch"] for d in rep["data"]} == {0} and len(rep["data"][0]["sequences"]) == 8
    step = rep["step"]
    head = f"lmsys-train: step {step}: loss {rep['loss']:.4g} is above log(V) + 1 = {ceiling:.4g}"
    assert f"{head}; largest gradients in" in run.stdout, run.stdout
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("lmsys-train: error: ")]
    assert len(errors) == 1 and "stopping (trainer.on_nonfinite=stop)" in errors[0], run.stderr
    assert [r["step"] for r in run.records("train")][-1] == step  # no step after it


def test_rewind_skips_the_bad_data_and_a_resume_skips_it_too(bad_runs, runs):
    run = bad_runs["rewound"].check()
    nan = report(run, "nonfinite-step-4.json")
    assert (nan["rank"], nan["micro_batch"], nan["module"], nan["pass"]) == (0, 0, "blocks.1.ffn", "forward")
    skipped = json.loads((run.run_dir / "diagnostics" / "skipped-data.json").read_text())["skipped"]
    assert skipped == [{"step": 4, "data_step": 3, "rewound_to": 2, "report": "nonfinite-step-4.json"}]
    assert "warning: step 4: loss is nan; rewound to the checkpoint of step 2" in run.stderr
    steps = [r["step"] for r in run.records("train")]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]  # step 4 went wrong; 3..6 again, step 4 on new data
    rewound = {r["step"]: r["loss"] for r in run.records("train")[4:]}
    for tag in ("step_0000004", "step_0000006"):  # every later checkpoint carries the skip
        for rank in (0, 1):
            state = json.loads((run.run_dir / "checkpoints" / tag / f"rank_{rank:05d}.json").read_text())
            assert state["loader"]["skipped_steps"] == [3]
    # a resume from step 2 (saved before the rewind) learns the skip from skipped-data.json
    overrides = [o for o in run.overrides if not o.startswith(("debug.", "trainer.run_dir="))]
    resume = f"trainer.resume={run.run_dir}/checkpoints/step_0000002"
    resumed = run_train("resumed", 2, [*overrides, resume], run.run_dir).check()
    assert "never training on the data of 1 step(s) a rewind skipped" in resumed.stdout
    assert {s: loss for s, loss in resumed.losses().items() if s > 2} == rewound


def test_a_replay_that_runs_out_of_memory_is_reported_and_the_run_goes_on(bad_runs):
    """ZeRO-3, 2 ranks. Step 2: rank 1 cannot allocate its copy of the model, so neither rank
    joins the gather (rank 0 would wait there forever); step 4: rank 0's replay runs out of memory
    in its forward while rank 1's finds the injected NaN. Both steps are skipped and the run ends."""
    run = bad_runs["short_of_memory"].check()
    refused = "DefaultCPUAllocator: can't allocate memory"
    copy = report(run, "nonfinite-step-2.json")
    assert copy["findings"] == [] and copy["module"] is None
    (skipped, short) = copy["replay_did_not_fit"]
    assert skipped == {
        "rank": 0,
        "out_of_memory": False,
        "error": "skipped: rank(s) 1 could not allocate the copy",
    }
    assert (short["rank"], short["out_of_memory"]) == (1, True) and short["error"].startswith(
        "the copy of the model: "
    )
    assert refused in short["error"], short
    line = (
        "lmsys-train: step 2: gradient is non-finite; its replay ran out of memory on rank(s) 1 "
        f"(report: replay_did_not_fit); report: {run.run_dir}/diagnostics/nonfinite-step-2.json"
    )
    assert line in run.stdout.splitlines(), run.stdout
    forward = report(run, "nonfinite-step-4.json")
    assert (forward["rank"], forward["module"], forward["pass"]) == (1, "blocks.0.ffn", "forward")
    (short,) = forward["replay_did_not_fit"]
    assert (short["rank"], short["out_of_memory"]) == (0, True), short
    assert short["error"].startswith("the replay: ") and refused in short["error"], short
    assert "its replay ran out of memory on rank(s) 0 (report: replay_did_not_fit)" in run.stdout
    assert "skipped the update (2 of trainer.max_nan_skips=5)" in run.stderr
    assert [r["step"] for r in run.records("train")] == [1, 2, 3, 4, 5]
