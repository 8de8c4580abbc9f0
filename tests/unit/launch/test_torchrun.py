"""launch/torchrun.py's decisions, in this process: nodes, processes per node and the rendezvous
from arguments, the environment and a SLURM allocation; the workers' SIGUSR1 and its time to save;
bad input as one launch error; which peer's loss becomes the survivors' line. Real launches:
tests/integration/launch/test_torchrun.py."""

from __future__ import annotations

import argparse

import pytest

from launch.torchrun import LaunchError, build_parser, job_layout


def test_one_node_is_standalone_with_two_cpu_processes():
    p = layout(["--", "model=tiny"], {})
    assert (p.nproc, p.nnodes, p.endpoint) == (2, 1, None)
    args = p.torchrun_args(["model=tiny"])
    assert "--standalone" in args and "--nproc-per-node=2" in args
    assert args[-3:] == ["-m", "lmsys.train", "model=tiny"]


def test_workers_get_sigusr1_and_time_to_save():
    args = layout([], {}).torchrun_args([])
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args  # SLURM's time-limit warning
    assert "--shutdown-timeout=300" in args
    given = layout(["--shutdown-timeout", "60"], {"SHUTDOWN_TIMEOUT": "90"})  # the option wins
    assert "--shutdown-timeout=60" in given.torchrun_args([])
    assert "--shutdown-timeout=90" in layout([], {"SHUTDOWN_TIMEOUT": "90"}).torchrun_args([])
    with pytest.raises(LaunchError, match="SHUTDOWN_TIMEOUT=0 must be >= 1"):
        layout([], {"SHUTDOWN_TIMEOUT": "0"})


def test_nproc_from_argument_env_and_slurm_gpus():
    assert layout(["--nproc", "3"], {"NPROC": "5"}).nproc == 3
    assert layout([], {"NPROC": "5"}).nproc == 5
    assert layout([], {"SLURM_GPUS_ON_NODE": "8"}).nproc == 8
    assert layout([], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).nproc == 4


def test_many_nodes_from_master_addr_and_port():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "NNODES": "2", "NODE_RANK": "1"}
    p = layout(["--nproc", "1"], env)
    assert (p.nnodes, p.node_rank, p.endpoint, p.hosts_store) == (2, 1, "127.0.0.1:29555", False)
    args = p.torchrun_args([])
    assert "--rdzv-backend=c10d" in args and "--nnodes=2" in args
    assert any(a.startswith("--rdzv-conf=join_timeout=") and "is_host=false" in a for a in args)
    assert p.rdzv_id == layout(["--nproc", "1"], {**env, "NODE_RANK": "0"}).rdzv_id  # same id on every node
    assert layout(["--nproc", "1"], {**env, "NODE_RANK": "0"}).hosts_store is True


def test_rdzv_endpoint_wins_over_master_addr():
    env = {"RDZV_ENDPOINT": "10.1.2.3:1234", "MASTER_ADDR": "127.0.0.1", "NNODES": "2", "NODE_RANK": "1"}
    assert layout([], env).endpoint == "10.1.2.3:1234"
    assert layout(["--rdzv-endpoint", "10.9.9.9"], env).endpoint == "10.9.9.9:29400"


def test_slurm_allocation_gives_nodes_rank_and_id():
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_GPUS_ON_NODE": "8",
    }
    p = layout(["--rdzv-endpoint", "node001:29400"], env)
    assert (p.nnodes, p.node_rank, p.nproc, p.rdzv_id, p.hosts_store) == (4, 2, 8, "4242", False)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--nnodes", "2"], {}, "need a rendezvous endpoint"),
        (
            ["--nnodes", "2"],
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"},
            "does not match the SLURM allocation",
        ),
        (
            [],
            {"NNODES": "3", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"},
            "does not match the SLURM allocation",
        ),
        (
            ["--rdzv-endpoint", "h:1"],
            {
                "SLURM_JOB_ID": "7",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_TASKS": "4",
            },
            "run exactly one per node",
        ),
        (["--rdzv-endpoint", "h:1"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}, "outside a job step"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], {}, "not below the node count"),
        (["--rdzv-endpoint", "h:99999"], {}, "not in 1..65535"),
        (["--nproc", "0"], {}, "must be >= 1"),
    ],
)
def test_bad_input_is_a_launch_error(argv, env, message):
    with pytest.raises(LaunchError, match=message):
        layout(argv, env)


def test_only_a_lost_peer_becomes_the_survivors_line(monkeypatch):
    from lmsys.train import lost_peer

    gone = _raised_in_torch_distributed(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:34718. This is typically caused by a remote worker crashing."
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert lost_peer(gone) == (
        "rank 0: another rank left the job: all_reduce failed (Connection closed by peer [127.0.0.1]:34718); "
        "the launcher's line names the rank that failed"
    )
    assert (
        lost_peer(_raised_in_torch_distributed("Tensors must be contiguous")) is None
    )  # a bug: its traceback
    assert lost_peer(RuntimeError("Connection closed by peer")) is None  # not from a collective
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_peer(gone) is None


def layout(argv: list[str], env: dict[str, str]):
    args: argparse.Namespace = build_parser().parse_args(argv)
    return job_layout(args, {"CUDA_VISIBLE_DEVICES": "", **env})


def _raised_in_torch_distributed(message: str) -> RuntimeError:
    """A RuntimeError whose traceback ends in torch.distributed's code, as a failed collective's does."""
    code = compile(
        f"def all_reduce():\n    raise RuntimeError({message!r})\n",
        "torch/distributed/distributed_c10d.py",
        "exec",
    )
    scope: dict = {}
    exec(code, scope)
    try:
        scope["all_reduce"]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")
