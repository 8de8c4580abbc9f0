"""The error vocabulary of lmsys: every mistake a user can make, and how a command reports it.

Each raises a subclass of `LmsysError` whose message is one line naming the bad value and what
would be valid. Commands catch `LmsysError` in one place (`lmsys.cli.run_cli`): the message goes
to stderr as `<prog>: error: <message>` and the process exits with the error's `exit_code`, 2 for
a mistake in the input, 1 for a run that failed on its own (too many NaN losses). A run stopped
by a signal after saving (`Stopped`) is no error: it exits EXIT_REQUEUE (75) or 130.

This module imports nothing, so every layer (the light CLIs included) can raise these.
"""

from __future__ import annotations


class LmsysError(ValueError):
    """A mistake in what the user gave lmsys; one line, exit status `exit_code`."""

    exit_code = 2


class UsageError(LmsysError):
    """A command-line mistake: an unknown option, a value of the wrong kind."""


class ConfigError(UsageError):
    """A configuration mistake: a misspelled key, a value out of range; names the key."""


class DataError(LmsysError):
    """Bad text or prepared data: a missing source, undecodable bytes, corrupt shards, a tokenizer
    that does not match."""


class CheckpointError(LmsysError):
    """A checkpoint that is damaged or cannot serve this run."""


class ExportError(LmsysError):
    """A missing, corrupt or mismatching export or checkpoint file for the export tools."""


class NoSpaceError(LmsysError):
    """The filesystem filled up while lmsys wrote a checkpoint or an export: the partial output is
    removed, what was there before is intact (lmsys.core.files.disk_full_line)."""


class TrainingError(LmsysError, RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses): the run failed, the input was fine."""

    exit_code = 1


# The exit status of a run stopped by SIGTERM or SIGUSR1 (a preemption, a time limit) after it saved
# a checkpoint of its last step: EX_TEMPFAIL of sysexits.h, "try again later". launch/torchrun.py,
# launch/sweep.py and launch/slurm.sbatch pass it on; the SLURM script requeues the job on it.
EXIT_REQUEUE = 75
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as lmsys.cli.run_cli reports it
# A job ended by the hang watchdog (lmsys/training/watchdog.py): a rank made no progress for
# trainer.hang_timeout_s; the line names it. Not 124 (coreutils `timeout`), which a wrapper may use.
EXIT_STUCK_RANK = 86


class Stopped(Exception):
    """Not a failure: training stopped on a signal after saving a checkpoint of its last step.
    `exit_code`: EXIT_REQUEUE after SIGTERM / SIGUSR1, EXIT_INTERRUPTED after Ctrl-C."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
