"""SIGTERM, from the entrypoint's first line to its last: what Kubernetes and Slurm send before a kill.

Kept apart from the callbacks (which act on it during training) because it must be set up before TensorFlow
loads, and callbacks.py imports TensorFlow.

Why a thread waits for it rather than a signal handler: while the multi-worker strategy forms, the main thread
is inside TensorFlow's C++ code, which holds Python's GIL (no Python handler runs until it returns) and installs a
SIGTERM handler of its own there (its preemption notifier, which swallows the signal). So SIGTERM is blocked in the
main thread before TensorFlow starts any thread (they inherit the mask), and one Python thread takes it with
`signal.sigwait` as soon as the GIL is free (docs/faults.md, "Pre-emption (SIGTERM)").
"""

import atexit
import contextlib
import os
import signal
import sys
import threading

from machinery.exits import EXIT_PREEMPTED, Preempted
from machinery import scratch

OUTSIDE_TRAINING = ("pre-empted (SIGTERM) outside training; run the same command again to resume after the last "
                    "backed-up step")
# How long the process's exit handlers and the flush of its output get before the process ends anyway
# (end_process): the main thread may hold what they wait for.
TIDY_SECONDS = 2


class Preemption:
    """SIGTERM while training is noted (`requested`) and acted on at the next step boundary by callbacks.Backup,
    which sets `training`; at any other moment the run ends at once with 143, since the backup already holds all
    the training done and every output is written whole or not at all (docs/faults.md, "Safe outputs").

    Outside training the process ends from SIGTERM's own thread: nothing is raised into the main thread, which may
    be anywhere (an import, TensorFlow's tracing, a C++ call), where an exception gave tracebacks, exit 1 or a
    hang."""

    def __init__(self):
        self.training = False
        self.requested = False
        self._lock = threading.Lock()  # the states below change together
        self._ending = False  # SIGTERM's thread is ending the process
        self._finishing = False  # the run is writing its results
        self._closing = False
        self._stderr = None  # fd 2 as it was at the start: the terminal's, even while TensorFlow's output is held

    def start_training(self):
        with self._lock:
            self.training = True

    def end_training(self):
        """Training is over: a SIGTERM noted since the last step boundary ends the run now, in the main thread."""
        with self._lock:
            self.training, requested = False, self.requested
        if requested:
            raise Preempted(OUTSIDE_TRAINING)

    def finishing(self):
        """The run writes its results now and ends in moments: a later SIGTERM is ignored, for a restart would
        find a finished run and refuse it. After one that came first, the main thread waits here for the end."""
        with self._lock:
            self._finishing, ending = True, self._ending
        if ending:
            threading.Event().wait()

    def _wait(self):
        while True:
            signal.sigwait({signal.SIGTERM})
            if self._closing:
                return
            with self._lock:
                if self._finishing:
                    continue
                if self.training:
                    self.requested = True
                    continue
                self._ending = True
            self._end()

    def _end(self):
        os.write(self._stderr, f"error: {OUTSIDE_TRAINING}\n".encode())
        end_process(EXIT_PREEMPTED)


def end_process(status):
    """Ends this process now with `status`, without the interpreter's teardown (TensorFlow's may hang, or log
    errors): the exit handlers still run and the output is flushed, within TIDY_SECONDS, and the process's scratch
    folder is removed last (scratch.py), when nothing it runs writes there any more."""
    tidy = threading.Thread(target=_tidy, name="exit-tidy", daemon=True)
    tidy.start()
    tidy.join(TIDY_SECONDS)
    scratch.remove()
    os._exit(status)


def _tidy():
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def watched():
    """Yields the run's Preemption, with SIGTERM taken by its thread until the block ends, and ignored after."""
    preemption = Preemption()
    preemption._stderr = os.dup(2)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    waiter = threading.Thread(target=preemption._wait, name="sigterm", daemon=True)
    waiter.start()
    try:
        yield preemption
    finally:
        preemption._closing = True
        signal.pthread_kill(waiter.ident, signal.SIGTERM)
        waiter.join()
        os.close(preemption._stderr)
        # SIGTERM stays blocked: the run's exit status is decided by now, and a SIGTERM in its last moments (or
        # in the interpreter's exit) must not turn a finished run into one killed by the signal, which the
        # scheduler would restart only to find it finished.


# ---------------------------------------------------------------- a command that runs Python throughout

class Stopped(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (`raised`), and like it no Exception:
    nothing on the way out takes it for an error of its own."""


@contextlib.contextmanager
def raised():
    """SIGTERM raises Stopped in the main thread while the block runs, and stays blocked after it (as `watched`
    leaves it). For a command whose main thread runs Python throughout (prepare_mnist.py): what it was writing is
    cleaned up on the way out, as for Ctrl-C. The entrypoint cannot do this (see the top of this module)."""
    def stop(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, previous)
