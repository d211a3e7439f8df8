"""SIGTERM at any moment of a whole run, start-up included, each moment in a fresh process: the run ends within
seconds with 143 and its one line, no traceback, or finishes with 0 when the signal came as it wrote its results;
and the same command then finishes what is left, every image trained once, with nothing half-written in its way."""

import json
import signal
import time

import pytest

from machinery.exits import EXIT_OK, EXIT_PREEMPTED
from processes import EXIT_SECONDS, Worker, finish, wait_until
from runs import SMOKE_BATCH, SMOKE_EPOCHS, SMOKE_STEPS, smoke_args

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

MOMENTS = 8  # spread evenly over an uninterrupted run's length
TOTAL_IMAGES = SMOKE_EPOCHS * SMOKE_STEPS * SMOKE_BATCH


def _sigterm_blocked(pid):
    """True once the process blocks SIGTERM (sigterm.watched): from then on its own thread takes it. Before that
    (the interpreter's start) SIGTERM ends it as the kernel does, by the signal."""
    with open(f"/proc/{pid}/status") as f:
        blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(blocked & 1 << (signal.SIGTERM - 1))


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def run_seconds(smoke_ok):
    """How long a whole run of the smoke run's size lasts, from its interpreter's start to its last phase's end, as
    the smoke run's own clock says (results.json's phase_ends; that run validates too, so it lasts a little longer)."""
    ends = smoke_ok.results["phase_ends"]
    return max(ends.values()) - min(ends.values())


def test_sigterm_at_any_moment_ends_cleanly_and_the_restart_finishes(tmp_path, data_dir, run_seconds):
    seen = []
    for moment in range(MOMENTS):
        delay = run_seconds * (moment + 0.5) / MOMENTS
        out = tmp_path / f"out{moment}"
        worker = Worker(smoke_args(data_dir, str(out)), {}, tmp_path, f"term{moment}")

        def blocked():
            assert worker.proc.poll() is None, worker.stderr[-3000:]
            return _sigterm_blocked(worker.proc.pid)
        wait_until(blocked, "SIGTERM blocked in the process")
        time.sleep(delay)
        stage = (worker.stdout.strip().splitlines() or ["(nothing printed yet)"])[-1][-70:]
        sent = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        (status,) = finish([worker], timeout=EXIT_SECONDS)
        seconds = time.monotonic() - sent
        seen.append(f"{delay:5.1f} s  exit {status} after {seconds:.2f} s  at: {stage}")
        assert "Traceback" not in worker.stderr, worker.stderr[-3000:]
        if status == EXIT_OK:  # it was writing its results: a finished run
            assert json.loads((out / "results.json").read_text())["train_images"] == TOTAL_IMAGES
            continue
        assert status == EXIT_PREEMPTED, (seen, worker.stdout[-1000:], worker.stderr[-3000:])
        errors = _error_lines(worker.stderr)
        assert len(errors) == 1 and errors[0].startswith("error: pre-empted (SIGTERM)"), worker.stderr[-3000:]
        if not out.exists():
            continue  # ended before writing anything: a restart is a fresh run
        again = Worker(smoke_args(data_dir, str(out)), {}, tmp_path, f"again{moment}")
        assert finish([again], timeout=300) == [EXIT_OK], again.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        assert results["resumed_after_images"] + results["train_images"] == TOTAL_IMAGES
    print("\nSIGTERM across a run of %.1f s:\n  %s" % (run_seconds, "\n  ".join(seen)))
