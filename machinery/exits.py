"""Exit statuses and the exceptions that lead to them: one table of them (README, "Exit codes").

Schedulers act on them (deploy/): Kubeflow's TFJob `restartPolicy: ExitCode`, and the podFailurePolicy of the
Indexed Job and the JobSet, restart a worker on the retryable statuses below and give up on the permanent ones.
"""

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # permanent until fixed (bad input, a full disk, no intact backup): one `error: <problem>; <fix>` line, nothing written lost
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_PEER_LOST = 138  # another worker was lost or never came; restart every worker to resume (128 + SIGUSR1, "retryable")
EXIT_PREEMPTED = 143  # SIGTERM: state saved, restart to resume (128 + SIGTERM)
# Beside the project's own: 1 an uncaught error, 126-128 a command that could not run, 139 a crash (SIGSEGV), and
# 137 SIGKILL (a grace period over, or out of memory). Any other status is left to the scheduler's default.
PERMANENT_EXIT_STATUSES = (1, EXIT_BAD_INPUT, 126, 127, 128, 139)
RETRYABLE_EXIT_STATUSES = (EXIT_INTERRUPTED, 137, EXIT_PEER_LOST, EXIT_PREEMPTED)


class UsageError(Exception):
    """A mistake the user can fix; the entrypoints print it as one line and exit non-zero."""


class Preempted(Exception):
    """SIGTERM ended the run after its state was saved; the same command resumes it (sigterm.Preemption)."""


class ClusterNotFormed(Exception):
    """A multi-worker cluster could not form: a worker never came, or this one's port is taken. Retryable (exit
    138): a restart usually finds the worker there or the port free (docs/clusters.md, "Start-up")."""
