"""SIGTERM, from the entrypoint's first line to its last: what Kubernetes and Slurm send before a kill.

Kept apart from the callbacks (which act on it during training) because it must be set up before TensorFlow
loads, and callbacks.py imports TensorFlow.

Why a thread waits for it rather than a signal handler: while the multi-worker strategy forms, the main thread
is inside TensorFlow's C++ code, which holds Python's GIL (no Python handler runs until it returns) and installs a
SIGTERM handler of its own there (its preemption notifier, which swallows the signal). So SIGTERM is blocked in the
main thread before TensorFlow starts any thread (they inherit the mask), and one Python thread takes it with
`signal.sigwait` as soon as the GIL is free (docs/faults.md, "Pre-emption (SIGTERM)").
"""

import _thread
import contextlib
import os
import signal
import threading

from config import EXIT_PREEMPTED, Preempted

OUTSIDE_TRAINING = ("pre-empted (SIGTERM) outside training; run the same command again to resume after the last "
                    "backed-up step")
# How long the main thread gets to act on SIGTERM itself (raise Preempted at its next Python line, and leave
# through the entrypoint's usual exit) before the process ends anyway: it may be waiting inside C++ code that
# releases the GIL but does not return soon.
GRACE_SECONDS = 2


class Preemption:
    """SIGTERM while training is noted (`requested`) and acted on at the next step boundary by callbacks.Backup,
    which sets `training`; at any other moment it ends the run at once with 143, since the backup already holds
    all the training done."""

    def __init__(self):
        self.training = False
        self.requested = False
        self._taken = threading.Event()
        self._closing = False
        self._stderr = None  # fd 2 as it was at the start: the terminal's, even while TensorFlow's output is held

    def _wait(self):
        while True:
            signal.sigwait({signal.SIGTERM})
            if self._closing:
                return
            if self.training:
                self.requested = True
                continue
            _thread.interrupt_main(signal.SIGTERM)  # runs _in_main in the main thread, at its next Python line
            if not self._taken.wait(GRACE_SECONDS):
                os.write(self._stderr, f"error: {OUTSIDE_TRAINING}\n".encode())
                os._exit(EXIT_PREEMPTED)

    def _in_main(self, signum, frame):
        self._taken.set()
        raise Preempted(OUTSIDE_TRAINING)


@contextlib.contextmanager
def watched():
    """Yields the run's Preemption, with SIGTERM taken by its thread until the block ends."""
    preemption = Preemption()
    preemption._stderr = os.dup(2)
    handler = signal.signal(signal.SIGTERM, preemption._in_main)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    waiter = threading.Thread(target=preemption._wait, name="sigterm", daemon=True)
    waiter.start()
    try:
        yield preemption
    finally:
        preemption._closing = True
        signal.pthread_kill(waiter.ident, signal.SIGTERM)
        waiter.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, handler)
        os.close(preemption._stderr)
