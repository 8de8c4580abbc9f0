"""The plan against published outcomes (docs/planning.md, "Against published runs"): runs that
trained and runs that ran out of memory, each as the lmsys configuration that holds the same model
and batch, with the verdict the plan must give; and the throughput of llm.c's and llm-foundry's
published runs, which the plan's MFU assumptions come from, within 25%."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmsys.core.config import compose
from lmsys.core.devices import device_spec
from lmsys.core.runtime import split_batch
from lmsys.planning.planner import plan_launch, step_time
from lmsys.planning.trace import trace_step

XL = ["model=gpt2_1558m", "deepspeed.precision=fp16"]  # DeepSpeed's tutorials trained in fp16 on V100s
# Megatron-LM's GPT-2 of DeepSpeed's tutorials: GPT-2's blocks at another width and depth
TEN_B = XL + ["model.n_layers=50", "model.d_model=4096", "model.n_heads=32", "model.ffn.d_ff=16384"]
BUCKETS_5E8 = ["deepspeed.reduce_bucket_size=500000000", "deepspeed.allgather_bucket_size=500000000"]
NO_BIAS = [f"model.attention.{b}_bias=false" for b in "qkvo"] + ["model.ffn.bias=false"]
# (what was published, overrides, world, device, it trained)
MEMORY = [
    ("ZeRO-Offload tutorial: 10B, ZeRO-2 offload, micro 10, checkpointing, one V100",
     TEN_B + BUCKETS_5E8 + ["deepspeed=zero2", "deepspeed.offload_optimizer=true",
                            "deepspeed.activation_checkpointing=true", "trainer.micro_batch_size=10",
                            "trainer.global_batch_tokens=10240"], 1, "v100-32gb", True),
    ("the same without offload (ZeRO-Offload paper: 1.4B is the largest without it)",
     TEN_B + BUCKETS_5E8 + ["deepspeed=zero2", "deepspeed.activation_checkpointing=true",
                            "trainer.micro_batch_size=10", "trainer.global_batch_tokens=10240"],
     1, "v100-32gb", False),
    ("ZeRO tutorial: GPT-2 1.5B (16 heads), no ZeRO, micro 1, 8 V100s",
     XL + ["model.n_heads=16", "deepspeed=zero0", "trainer.micro_batch_size=1",
           "trainer.global_batch_tokens=8192"], 8, "v100-32gb", False),
    ("ZeRO tutorial: the same with ZeRO-1 (reduce bucket 5e8)",
     XL + BUCKETS_5E8 + ["model.n_heads=16", "deepspeed=zero1", "trainer.micro_batch_size=1",
                         "trainer.global_batch_tokens=8192"], 8, "v100-32gb", True),
    ("ZeRO tutorial: 10B, ZeRO-2, micro 1, checkpointing, 32 V100s",
     TEN_B + BUCKETS_5E8 + ["deepspeed=zero2", "deepspeed.activation_checkpointing=true",
                            "trainer.micro_batch_size=1", "trainer.global_batch_tokens=32768"],
     32, "v100-32gb", True),
    ("llm.c #677: GPT-2 1558M, micro 16, ZeRO-1, 8 H100s",
     ["model=gpt2_1558m", "trainer=gpt2", "deepspeed=zero1", "trainer.micro_batch_size=16",
      "trainer.global_batch_tokens=1048576"], 8, "h100", True),
    ("llm.c #481: GPT-2 124M, micro 64, 8 A100-80GB",
     ["model=gpt2_124m", "trainer=gpt2", "deepspeed=zero0", "trainer.micro_batch_size=64"],
     8, "a100-80gb", True),
    ("nanoGPT's train_gpt2 config: GPT-2 124M, micro 12, 8 A100-40GB",
     ["model=gpt2_124m", "trainer=gpt2", "deepspeed=zero0", "model.vocab_size=50304",
      "trainer.micro_batch_size=12", "trainer.global_batch_tokens=491520"], 8, "a100-40gb", True),
    ("nshepperd/gpt-2#37: GPT-2 1558M full fine-tune, one 16 GB V100",
     XL + ["deepspeed=zero0", "trainer.micro_batch_size=1", "trainer.global_batch_tokens=1024"],
     1, "v100-16gb", False),
    ("llm-foundry benchmarks: MPT-7B, FSDP full shard (ZeRO-3), T=2048, micro 12, checkpointing, 8 A100-40GB",
     ["model=gpt2_124m", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
      "model.ffn.d_ff=16384", "model.vocab_size=50432", "model.max_seq_len=2048", "data.seq_len=2048",
      *NO_BIAS, "deepspeed=zero3", "deepspeed.activation_checkpointing=true", "trainer.micro_batch_size=12",
      "trainer.global_batch_tokens=786432"], 8, "a100-40gb", True),
]  # fmt: skip


@pytest.mark.parametrize(
    "outcome, overrides, world, device, trained", MEMORY, ids=[m[0][:40] for m in MEMORY]
)
def test_the_plan_gives_each_published_runs_verdict(outcome, overrides, world, device, trained):
    plan = plan_launch(compose(overrides), world, device_spec(device), suggest=False)
    assert plan.fits == trained, (outcome, plan.peak_bytes / 2**30, plan.components, plan.host)


def test_offload_keeps_the_host_part_off_the_gpu():
    """The ZeRO-Offload tutorial's run: the fp32 master, moments and gradient partition (16 bytes
    a parameter) in the DGX-2's host memory, none of it on the GPU."""
    _, overrides, world, device, _ = MEMORY[0]
    plan = plan_launch(compose(overrides), world, device_spec(device), suggest=False)
    assert plan.components["optimizer_states"] == 0 and plan.host_fits
    assert plan.host["optimizer_states"] + plan.host["gradients"] == 16 * plan.n_params


MPT = ["model=gpt2_124m", "model.vocab_size=50368", "model.max_seq_len=2048", "data.seq_len=2048", *NO_BIAS]
SIZES = {  # MPT's 350M, 760M, 1B, 3B (llm-foundry's yamls): layers, width, heads
    350: ["model.n_layers=24", "model.d_model=1024", "model.n_heads=16", "model.ffn.d_ff=4096"],
    760: ["model.n_layers=24", "model.d_model=1536", "model.n_heads=12", "model.ffn.d_ff=6144"],
    1000: ["model.n_layers=24", "model.d_model=2048", "model.n_heads=16", "model.ffn.d_ff=8192"],
    3000: ["model.n_layers=32", "model.d_model=2560", "model.n_heads=20", "model.ffn.d_ff=10240"],
}
# (run, overrides, world, micro-batch, accumulation, ZeRO stage, device, published tokens/s for all GPUs):
# llm.c's discussions (their commands' -b, -d, -x, -z) and llm-foundry's
# scripts/train/benchmarking/README.md (T=2048, FSDP full shard: ZeRO-3)
THROUGHPUT = [
    ("llm.c #481: GPT-2 124M, 19,073 steps of 524,288 tokens in about 90 minutes", ["model=gpt2_124m"],
     8, 64, 1, 1, "a100-80gb", 19073 * 524288 / 5400),
    ("llm.c #677: GPT-2 1558M, 32,000 steps of 1,048,576 tokens in 24 hours", ["model=gpt2_1558m"],
     8, 16, 8, 1, "h100", 32000 * 1048576 / 86400),
    ("llm-foundry MPT-125M, A100-80GB", MPT, 8, 40, 2, 3, "a100-80gb", 1142641),
    ("llm-foundry MPT-350M, A100-80GB", MPT + SIZES[350], 8, 32, 2, 3, "a100-80gb", 470263),
    ("llm-foundry MPT-760M, A100-80GB", MPT + SIZES[760], 8, 24, 2, 3, "a100-80gb", 259472),
    ("llm-foundry MPT-1B, A100-80GB", MPT + SIZES[1000], 8, 14, 4, 3, "a100-80gb", 164109),
    ("llm-foundry MPT-760M, H100", MPT + SIZES[760], 8, 24, 2, 3, "h100", 505177),
    ("llm-foundry MPT-1B, H100", MPT + SIZES[1000], 8, 14, 1, 3, "h100", 363645),
    ("llm-foundry MPT-3B, H100, 16 GPUs", MPT + SIZES[3000], 16, 10, 3, 3, "h100", 386285),
]  # fmt: skip


@pytest.mark.parametrize("run, overrides, world, micro, accum, stage, device, published", THROUGHPUT,
                         ids=[t[0][:30] for t in THROUGHPUT])  # fmt: skip
def test_the_plans_throughput_is_within_a_quarter_of_published_runs(
    run, overrides, world, micro, accum, stage, device, published
):
    """The plan's tokens/s from the model's FLOPs at the device family's MFU, with the run's batch
    (the time needs only the FLOPs a token: a micro-batch of 1 is traced)."""
    cfg = compose(overrides)
    tokens = micro * accum * world * cfg.data.seq_len
    trainer = replace(cfg.trainer, micro_batch_size=micro, global_batch_tokens=tokens)
    cfg = replace(cfg, trainer=trainer, deepspeed=replace(cfg.deepspeed, stage=stage))
    batch = split_batch(cfg, world)
    seconds, *_ = step_time(cfg, world, device_spec(device), batch, trace_step(cfg, True, "bf16", 1))
    predicted = batch.tokens_per_step / seconds
    assert abs(predicted / published - 1) <= 0.25, (run, predicted, published)
