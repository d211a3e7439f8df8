"""Wall-clock stamps of where each of a run's phases ends, for results.json's `phase_ends`: benchmarks/phases.py
breaks the whole command down with them.

A step function marked `@ends("name")` stamps its phase's end as it returns, on the clock of the run that is
`running` (none outside a run: nothing is stamped), so the run itself carries no stamps between its steps. Stamps
are Unix times, as a benchmark outside the process reads its own clock.
"""

import contextlib
import contextvars
import functools
import time

_RUNNING = contextvars.ContextVar("the running run's PhaseClock", default=None)


class PhaseClock:
    """Where each phase ended, in order; the first, `started`, is the interpreter's start."""

    def __init__(self, started):
        self.ends = {"interpreter": started}

    def done(self, name):
        self.ends[name] = time.time()

    @contextlib.contextmanager
    def running(self):
        token = _RUNNING.set(self)
        try:
            yield self
        finally:
            _RUNNING.reset(token)


def ends(name):
    """Marks a step function whose return ends phase `name` of the running clock."""
    def mark(step):
        @functools.wraps(step)
        def stamped(*args, **kwargs):
            result = step(*args, **kwargs)
            clock = _RUNNING.get()
            if clock is not None:
                clock.done(name)
            return result

        return stamped

    return mark
