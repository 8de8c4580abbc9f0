"""Stuck ranks: a watchdog thread per rank that ends a job whose step stopped making progress,
naming the rank(s) that did not arrive.

A collective waits for every rank. When one rank freezes (SIGSTOP, a deadlock, a sleeping
syscall, a lost GPU) the others wait in the collective; gloo's and NCCL's timeouts do not always
fire (a rank frozen by SIGSTOP held a 2-rank CPU job for 150 s), and nothing says which
rank is to blame. So the training loop tells the watchdog, one of its components
(lmsys.training.components), where it is (`at(step, op, micro_batch)`: a plain attribute store, no
I/O), and a thread, started when the loop begins, wakes every few seconds:

1. When this rank has made no progress for trainer.hang_timeout_s, or another rank opened an
   incident, it joins the incident: it writes its Python stacks (faulthandler, every thread) and
   where it is to `<run>/diagnostics/hang-rank-<K>.txt`, and posts its position to the side
   channel (below).
2. After a grace period (every rank posted, or `grace_s` passed) the first rank to decide writes
   the verdict with compare-and-set, so every rank acts on the same one: the ranks whose position
   is behind the furthest one, and those that never answered (a frozen process answers nothing),
   did not arrive.
3. With such ranks, every rank that answered kills the ones on its own host with SIGKILL (which
   ends a stopped process too), the lowest waiting rank prints the one line, and all exit with
   EXIT_STUCK_RANK. The checkpoints on disk are complete ones (a save is atomic); the resume
   continues from the newest. When every rank waits at the same point, nobody is behind: the
   stacks are written, one warning says so, and the run goes on (a long first compile, a slow
   save) until trainer.dist_timeout_s.

The side channel is a client of torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT, hosted by
the torchrun agent, which a frozen worker does not freeze), under a prefix of this run's attempt.
A launcher that sets LMSYS_HANG_REPORT gets the line in that file (launch/torchrun.py relays it
and kills what is left of the job).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lmsys.core import rundir
from lmsys.core.errors import EXIT_STUCK_RANK
from lmsys.core.files import atomic_write_text
from lmsys.engine import checkpoint as ckpt
from lmsys.engine.runlock import release_held
from lmsys.training.components import Component, Loop

REPORT_ENV = "LMSYS_HANG_REPORT"  # a launcher's file for the line (launch/torchrun.py)


@dataclass(frozen=True)
class Position:
    """Where a rank is: the `seq`-th progress mark of this launch, in step `step`."""

    seq: int
    step: int
    micro_batch: int | None
    op: str

    def where(self) -> str:
        mb = "" if self.micro_batch is None else f" of micro-batch {self.micro_batch}"
        return f"step {self.step}'s {self.op}{mb} (mark #{self.seq})"


@dataclass(frozen=True)
class Verdict:
    behind: list[int]  # ranks that did not arrive, in order
    silent: list[int]  # of those, the ranks that never answered (frozen, dead)
    waiting: list[int]  # ranks at the furthest position
    lead: dict  # the furthest position (Position as a dict)
    positions: dict[str, dict]  # rank -> Position (as dicts) of every rank that answered


def decide(positions: dict[int, Position], world_size: int) -> Verdict:
    """Who did not arrive where the furthest rank waits."""
    lead = max(positions.values(), key=lambda p: p.seq)
    silent = [r for r in range(world_size) if r not in positions]
    late = [r for r, p in positions.items() if p.seq < lead.seq]
    waiting = sorted(r for r, p in positions.items() if p.seq == lead.seq)
    answered = {str(r): asdict(p) for r, p in positions.items()}
    return Verdict(sorted(silent + late), silent, waiting, asdict(lead), answered)


def describe(verdict: Verdict, timeout_s: float, stacks: str) -> str:
    """The one line: who did not reach what, who waits there, where the stacks are."""
    lead = Position(**verdict.lead)
    names = ",".join(map(str, verdict.behind))
    ranks = "rank" if len(verdict.behind) == 1 else "ranks"
    states = []
    for r in verdict.behind:
        if r in verdict.silent:
            states.append(f"rank {r} did not answer: stopped or dead")
        else:
            states.append(f"rank {r} is at {Position(**verdict.positions[str(r)]).where()}")
    waiters = ",".join(map(str, verdict.waiting))
    verb = "waits" if len(verdict.waiting) == 1 else "wait"
    return (
        f"{ranks} {names} did not reach {lead.where()} within {timeout_s:g} s: {', '.join(states)}; "
        f"{'rank' if len(verdict.waiting) == 1 else 'ranks'} {waiters} {verb} there; stacks in {stacks}"
    )


_launches = 0  # train() calls in this process (a Hydra multirun makes several): keys of their own


def side_channel(timeout_s: float, run_dir: Path, start_step: int) -> dist.Store | None:
    """A new client of the job's rendezvous store, under keys of this launch of this run (every
    rank derives the same), or None (a world of one needs no side channel)."""
    global _launches
    _launches += 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    launch = f"{run_id}/attempt_{attempt}/{run_dir.resolve()}/from_{start_step}/{_launches}"
    return dist.PrefixStore(f"lmsys/watchdog/{launch}/", store)


def resume_hint(run_dir: Path) -> str:
    """For the stuck-rank line: the newest checkpoint on disk, committed (an asynchronous save
    still in flight may never be)."""
    committed = [
        step
        for step, path in ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS)
        if (path / ckpt.MARKER).is_file()
    ]
    if not committed:
        return "; no checkpoint was saved yet"
    return f"; trainer.resume=auto continues from the checkpoint of step {committed[0]}"


class Watchdog(Component):
    """One rank's watchdog. The training loop marks its progress (`before_step`, `at`); the thread
    does the rest."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        world_size: int,
        run_dir: Path,
        prog: str,
        warn: Callable[[str], None],
    ) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.run_dir, self.prog, self.warn = run_dir, prog, warn
        self.poll_s = min(5.0, max(0.5, timeout_s / 10))
        self.grace_s = min(30.0, max(5.0, timeout_s / 2))  # for the other ranks to answer
        self.position = Position(0, 0, None, "start")
        self.last_progress = time.monotonic()
        self.incident = 0  # incidents without a culprit so far (each gets fresh store keys)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store: dist.Store | None = None

    # -- the training loop's side: cheap, no I/O -------------------------------------------------

    def begin(self, loop: Loop) -> None:
        self.start(loop.start_step)

    def before_step(self, step: int) -> None:
        self.at(step, "start")

    def at(self, step: int, op: str, micro_batch: int | None = None) -> None:
        self.position = Position(self.position.seq + 1, step, micro_batch, op)
        self.last_progress = time.monotonic()

    def end(self) -> None:
        self.stop()

    # -- the thread ------------------------------------------------------------------------------

    def start(self, start_step: int) -> Watchdog:
        try:
            self.store = side_channel(max(30.0, self.grace_s * 2), self.run_dir, start_step)
        except Exception as exc:  # no side channel: still write the stacks, name nobody
            self.warn(f"the hang watchdog cannot reach the rendezvous store ({exc}): stacks only")
            self.store = None
        if self.store is not None:
            self.store.set(f"pid/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._thread = threading.Thread(target=self._run, name="lmsys-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 1)

    def _key(self, name: str) -> str:
        return f"incident_{self.incident}/{name}"

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                idle = time.monotonic() - self.last_progress
                opened = self.store is not None and self.store.check([self._key("open")])
                if idle >= self.timeout_s or opened:
                    self._incident(idle)
            except Exception as exc:  # the watchdog must never take the run down by itself
                print(f"{self.prog}: warning: the hang watchdog stopped: {exc}", file=sys.stderr, flush=True)
                return

    def _write_stacks(self, position: Position, idle: float) -> None:
        path = rundir.hang_stacks_file(self.run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(
                f"rank {self.rank} of {self.world_size} (pid {os.getpid()}, host {socket.gethostname()}): "
                f"at {position.where()}, no progress for {idle:.1f} s (trainer.hang_timeout_s="
                f"{self.timeout_s:g})\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

    def _incident(self, idle: float) -> None:
        position = self.position  # one read: the loop may move on meanwhile
        self._write_stacks(position, idle)
        if self.store is None:  # a world of one: nobody to wait for, nobody to blame
            self.warn(
                f"no progress for {idle:.0f} s at {position.where()} (trainer.hang_timeout_s="
                f"{self.timeout_s:g}); stacks in {rundir.hang_stacks_file(self.run_dir, self.rank)}"
            )
            self.last_progress = time.monotonic()
            return
        store = self.store
        store.compare_set(self._key("open"), "", str(self.rank))
        store.set(self._key(f"pos/{self.rank}"), json.dumps(asdict(position)))
        store.add(self._key("answered"), 1)
        deadline = time.monotonic() + self.grace_s
        while store.add(self._key("answered"), 0) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
        positions = {
            r: Position(**json.loads(store.get(self._key(f"pos/{r}"))))
            for r in range(self.world_size)
            if store.check([self._key(f"pos/{r}")])
        }
        proposal = json.dumps(asdict(decide(positions, self.world_size)))
        agreed = store.compare_set(self._key("verdict"), "", proposal).decode()
        verdict = Verdict(**json.loads(agreed or proposal))
        if not verdict.behind:
            self.warn(
                f"every rank has made no progress for {self.timeout_s:g} s at "
                f"{Position(**verdict.lead).where()}; stacks in {rundir.diagnostics_dir(self.run_dir)}; "
                f"waiting on (trainer.dist_timeout_s ends a collective that never returns)"
            )
            self.incident += 1
            self.last_progress = time.monotonic()
            return
        self._end_job(verdict)

    def _end_job(self, verdict: Verdict) -> None:
        """Kill the ranks that did not arrive on this host, say the line, exit."""
        assert self.store is not None
        here = socket.gethostname()
        for r in verdict.behind:
            if r == self.rank or not self.store.check([f"pid/{r}"]):
                continue
            where = json.loads(self.store.get(f"pid/{r}"))
            if where["host"] == here:
                try:
                    os.kill(int(where["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        stacks = str(rundir.diagnostics_dir(self.run_dir) / rundir.HANG_STACKS_FILES)
        line = describe(verdict, self.timeout_s, stacks) + resume_hint(self.run_dir)
        report = os.environ.get(REPORT_ENV)
        if self.rank == min(verdict.waiting, default=self.rank):
            atomic_write_text(rundir.hang_line_file(self.run_dir), line + "\n")
            if not report:  # else the launcher says it, once
                sys.stdout.flush()
                print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
        if report and self.rank not in verdict.behind:
            atomic_write_text(Path(report), line + "\n")
        release_held()  # rank 0's run.lock: os._exit skips the release
        os._exit(EXIT_STUCK_RANK)  # the main thread waits in a collective that will never return
