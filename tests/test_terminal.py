"""A clean terminal: TensorFlow's C++ start-up notices are held back, everything else still shows."""

import os
import subprocess
import sys

import pytest

from machinery import terminal
from processes import ROOT, subprocess_env

# As TensorFlow 2.21 printed them at the start of a default run on this project's CPU machine.
NOTICES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1796284442.313924    3678 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. To turn "
    "them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n",
    "I0000 00:00:1796284442.314357    3678 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.\n",
]
CUINIT = ("E0000 00:00:1796284446.233957    3678 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)\n")
REAL_WARNING = "W0000 00:00:1796284702.197037    7973 dataset.cc:997] a warning someone can act on\n"


def _write_fd2(lines):
    for line in lines:
        os.write(2, line.encode())


def test_notices_are_held_back_and_everything_else_shows(capfd):
    with terminal.startup_output_held(verbose=False):
        _write_fd2(NOTICES + [REAL_WARNING, CUINIT])
    assert capfd.readouterr().err == REAL_WARNING


def test_cuinit_failure_shows_where_a_cuda_driver_exists(capfd):
    # Without the "Could not find cuda drivers" notice, a failed cuInit is a broken GPU set-up, not noise.
    with terminal.startup_output_held(verbose=False):
        _write_fd2(NOTICES[:2] + [CUINIT])
    assert capfd.readouterr().err == CUINIT


def test_verbose_shows_every_held_line(capfd):
    with terminal.startup_output_held(verbose=True):
        _write_fd2(NOTICES + [CUINIT])
    assert capfd.readouterr().err == "".join(NOTICES + [CUINIT])


def test_a_failed_start_shows_every_held_line_and_the_error_propagates(capfd):
    with pytest.raises(ImportError, match="no TensorFlow"):
        with terminal.startup_output_held(verbose=False):
            _write_fd2(NOTICES)
            raise ImportError("no TensorFlow")
    assert capfd.readouterr().err == "".join(NOTICES)
    # The real stderr is back in place afterwards.
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


@pytest.mark.slow
def test_verbose_start_shows_tensorflows_own_notices():
    """The real thing, in a fresh process: what TensorFlow prints while it starts is replayed with --verbose."""
    script = "from machinery import terminal as t; t.start_tensorflow(verbose=True); print('started')"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "started\n"
    assert "All log messages before absl::InitializeLog() is called" in proc.stderr, proc.stderr
