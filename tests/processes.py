"""The process harness: the entrypoint, the offline prepare and the benchmarks, started as users start them."""

# Every wait has a deadline of its own (wait_until, Worker.wait_for, wait_for_backup_after, finish), shorter than
# pytest.ini's timeout and more telling; events are ordered by handshakes (a line of output, a backup on disk),
# never by sleeping.

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's folder, where processes start

# Deadlines that only guard against a hang, generous for a loaded 2-core machine (TensorFlow alone takes 5-15 s
# to load there): a worker reaching a line of its output or a backup, and a signalled process's end (the product
# aims at well inside Kubernetes's 30 s grace period).
WAIT_SECONDS = 300
EXIT_SECONDS = 60


# ---------------------------------------------------------------- a process's environment

# What importing the entrypoint sets in a process's environment for itself (TensorFlow's allocator, tf.keras as
# tf_keras): a test that imports it leaves them in pytest's environment, and a process started after it, a Keras 3
# user's among them, must not inherit them; the entrypoint's own processes set them again.
SET_BY_THE_ENTRYPOINT = ("TF_CPU_ALLOCATOR_USE_BFC", "TF_USE_LEGACY_KERAS")


def subprocess_env():
    env = dict(os.environ)
    for name in ("TF_CONFIG", "PYTHONPATH", *SET_BY_THE_ENTRYPOINT):
        env.pop(name, None)
    return env


def run_benchmark(script, *args, timeout, run_in=()):
    """benchmarks/`script` with `args`, in a fresh process started from the project's folder as a user starts it;
    `run_in` a command prefix (netns.OWN_LOOPBACK)."""
    return subprocess.run([*run_in, sys.executable, os.path.join("benchmarks", script), *args], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- waits, ports

def wait_until(condition, what, seconds=WAIT_SECONDS):
    """Polls `condition()` until it returns something true, and returns that; fails saying `what` it waited for
    after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def free_ports(n, consecutive=False):
    """n ports nothing listens on now; `consecutive` for Slurm, whose workers on one node take base, base+1, ..."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            first = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", first + i if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue  # the next port up was taken; draw again
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports found in 100 draws")


# ---------------------------------------------------------------- the entrypoint in a process of its own

def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Worker:
    """One process of the entrypoint: the one way the tests start it. Its output goes to files (pipes nobody
    reads fill up and stall it), unbuffered so that a test can follow its progress, and its TMPDIR is a folder
    of its own, so a test sees what it leaves there."""

    def __init__(self, args, env, directory, name, run_in=(), script="train_mnist_mirrored.py", interruptible=False):
        """`run_in`: a command prefix that runs it elsewhere, e.g. on another host (tests/netns.py); `script`: the
        entrypoint or prepare_mnist.py. An `interruptible` one starts in a process group of its own with SIGINT's
        default action (a shell's background jobs ignore SIGINT, and their children inherit that), so that
        `interrupt()` is a terminal's Ctrl-C."""
        self.scratch = directory / name
        self.scratch.mkdir()
        self.stdout_path, self.stderr_path = directory / f"{name}.stdout", directory / f"{name}.stderr"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([*run_in, sys.executable, script, *args], cwd=ROOT,
                                         env={**subprocess_env(), "PYTHONUNBUFFERED": "1",
                                              "TMPDIR": str(self.scratch), **env},
                                         stdout=out, stderr=err, text=True, start_new_session=interruptible,
                                         preexec_fn=_sigint_default if interruptible else None)

    def interrupt(self):
        """Ctrl-C: SIGINT to the process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def stdout(self):
        return self.stdout_path.read_text()

    @property
    def stderr(self):
        return self.stderr_path.read_text()

    @property
    def last_stderr_line(self):
        return self.stderr.rstrip().splitlines()[-1]

    def wait_for(self, text, seconds=WAIT_SECONDS):
        """Returns once the worker has printed `text`; fails if it exits first, or after `seconds`."""
        def printed():
            if text in self.stdout:
                return True
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} before printing {text!r}:\n{self.stderr[-3000:]}")
            return False
        wait_until(printed, f"{text!r} from {self.stdout_path.stem}", seconds)


def finish(workers, timeout=400):
    """Waits for every worker (killing all of them if one hangs) and returns their exit statuses."""
    try:
        return [w.proc.wait(timeout=timeout) for w in workers]
    finally:
        for w in workers:
            w.proc.kill()


def run_entrypoint(args, directory, env=None, timeout=600, script="train_mnist_mirrored.py"):
    """Runs the entrypoint to its end, as a Worker of its own under `directory`; returns it. `script`: another copy
    of the entrypoint (a user's, tests/test_template.py)."""
    name = tempfile.mkdtemp(prefix="run", dir=directory)
    os.rmdir(name)
    worker = Worker(args, env or {}, pathlib.Path(directory), os.path.basename(name), script=script)
    finish([worker], timeout)
    return worker


# ---------------------------------------------------------------- a run's progress: its backups and its lines

def backed_up_images(backup_dir):
    """The training images the backup in `backup_dir` has trained (0 without one), or None while its checkpoint
    is being replaced."""
    from machinery import resume

    try:
        position = resume.read(backup_dir)
    except Exception:  # noqa: BLE001 - read while the checkpoint was being replaced; look again
        return None
    return position.epoch * position.settings.epoch_images + position.image if position else 0


def images_at(output, what):
    """The training images done at each "<what> ... at epoch E, image I of N" in `output`: (E - 1) x N + I. The
    run says so where it stops after SIGTERM ("pre-empted (SIGTERM)") and where it resumes ("Resuming from")."""
    number = r"(\d[\d,]*)"
    found = re.findall(re.escape(what) + rf"[^\n]*? at epoch {number}, image {number} of {number}", output)
    return [(int(epoch) - 1) * int(size.replace(",", "")) + int(image.replace(",", ""))
            for epoch, image, size in found]


def wait_for_backup_after(backup_dir, images, running, seconds=WAIT_SECONDS):
    """Returns once a backup past `images` training images is on disk; fails if `running()` turns false first, or
    after `seconds`."""
    def backed_up():
        if (backed_up_images(backup_dir) or 0) > images:
            return True
        assert running(), f"the run ended before a backup past image {images}"
        return False
    wait_until(backed_up, f"backup past image {images}", seconds)


# ---------------------------------------------------------------- what the machine cannot run: daemons, namespaces

def skip_unless_ci(reason):
    """Skips a test the machine cannot run (no root, a package or daemon missing); CI, which must run every
    test (.ci/run installs what they need and sets CI), fails instead."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}, and CI must run this test")
    pytest.skip(reason)


def started(kind, *args, **kwargs):
    """kind(*args, **kwargs), for daemons or network namespaces; if they cannot start, skip_unless_ci."""
    try:
        return kind(*args, **kwargs)
    except (RuntimeError, subprocess.CalledProcessError) as err:
        skip_unless_ci(f"{kind.__name__} did not start: {getattr(err, 'stderr', None) or err}")


# ---------------------------------------------------------------- refusals (exit 2, one line) and warnings

def apply_env(monkeypatch, variables):
    """Sets each of `variables` in the environment, or unsets it where its value is None."""
    for name, value in variables.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def assert_refused_in_one_line(status, stderr, words, output_dir):
    """Bad input: exit 2 and one `error:` line on stderr holding each of `words`, and nothing written."""
    lines = stderr.strip().splitlines()
    assert status == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not os.path.exists(output_dir)
    return lines[0]


def run_under_broken_tf_config(monkeypatch, tmp_path, capsys):
    """A multi-worker run's status and stderr line with an unreadable TF_CONFIG set beside whatever else the test
    set: TF_CONFIG wins over the other sources of workers, so its line is the one given."""
    import train_mnist_mirrored

    monkeypatch.setenv("TF_CONFIG", "{not json")
    status = train_mnist_mirrored.main(["--strategy", "multiworker", "--output-dir", str(tmp_path / "out")])
    return status, capsys.readouterr().err.strip()


def assert_one_port_warning(stderr, port):
    warnings = [line for line in stderr.splitlines() if "unauthenticated" in line]
    assert len(warnings) == 1 and f"port {port} " in warnings[0], stderr[-3000:]
