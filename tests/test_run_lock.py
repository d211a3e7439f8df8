"""One run per output folder: a second run into a folder a live run holds stops at once (exit 2, one line naming
the holder's host, process id and start time) and the first finishes unharmed. A holder killed outright blocks
nothing, and the same command resumes from its backup: test_preemption.py's SIGKILL test."""

import errno
import fcntl
import glob
import json
import os
import signal
import socket
import subprocess
import time

import pytest

import config
from machinery import run_lock
import train_mnist_mirrored
from machinery import worker_sources
from processes import Worker, finish, run_entrypoint
from runs import smoke_args
from machinery import exits

HANDSHAKE_SECONDS = 120  # a guard against a hang: TensorFlow is not loaded before the lock is taken


def until(condition, what, running):
    """Returns once `condition()` is true; fails if `running()` turns false first, or after HANDSHAKE_SECONDS."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    while not condition():
        assert running(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {HANDSHAKE_SECONDS} s"
        time.sleep(0.1)


def described_by(path, pid):
    """Whether the lock file at `path` names process `pid` as its holder."""
    try:
        with open(path) as f:
            return json.load(f)["pid"] == pid
    except (OSError, ValueError):
        return False


def snapshot(folder):
    """Every file under `folder` with its size and modification time."""
    return {path: (os.stat(path).st_size, os.stat(path).st_mtime_ns)
            for path in glob.glob(os.path.join(folder, "**"), recursive=True)}


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_is_refused_and_the_first_finishes(tmp_path, data_dir):
    output_dir = str(tmp_path / "out")
    args = smoke_args(data_dir, output_dir)
    lock = os.path.join(output_dir, config.Config().lock_file)
    first = Worker(args, {}, tmp_path, "first")
    try:
        until(lambda: described_by(lock, first.proc.pid), "the lock taken", lambda: first.proc.poll() is None)
        # Stopped, the first cannot finish meanwhile: the two runs overlap whatever the machine's speed.
        first.proc.send_signal(signal.SIGSTOP)
        before = snapshot(output_dir)
        started = time.monotonic()
        second = run_entrypoint(args, tmp_path, timeout=HANDSHAKE_SECONDS)
        second_seconds = time.monotonic() - started
        assert snapshot(output_dir) == before  # the second wrote nothing
        first.proc.send_signal(signal.SIGCONT)
        status, = finish([first])
    finally:
        first.proc.kill()
    print(f"\nthe second run was refused in {second_seconds:.1f} s")
    lines = second.stderr.strip().splitlines()
    assert second.returncode == exits.EXIT_BAD_INPUT, second.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {output_dir} is in use by another run"), lines
    assert f"host {socket.gethostname()}, process id {first.proc.pid}, started " in lines[0], lines[0]
    assert "choose another --output-dir" in lines[0]
    assert "Number of devices" not in second.stdout  # refused before TensorFlow started
    # The first ran to its end alone: one TensorBoard event file, its results, and the lock's file gone.
    assert status == 0, first.stderr[-3000:]
    assert len(glob.glob(os.path.join(output_dir, "logs", "train", "events.out.tfevents.*"))) == 1
    assert os.path.exists(os.path.join(output_dir, "results.json")) and not os.path.exists(lock)


@pytest.mark.parametrize("environ", [
    {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                              "task": {"type": "worker", "index": 0}})},
    {"TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                              "task": {"type": "chief", "index": 0}})},
    {"JOB_COMPLETION_INDEX": "0", "MNIST_WORKERS": "2", "MNIST_WORKER_HOST": "job-{index}.workers",
     "MNIST_WORKER_PORT": "2222"},
    {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
     "SLURM_STEP_TASKS_PER_NODE": "2"},
], ids=["tf-config-worker-0", "tf-config-chief", "indexed-job-pod-0", "slurm-task-0"])
def test_the_chief_of_each_source_is_refused_where_another_run_holds_the_folder(environ, tmp_path, monkeypatch,
                                                                                capsys):
    """Held by another process (util-linux's flock, which says nothing of itself), before TensorFlow starts."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    lock = output_dir / config.Config().lock_file
    holder = subprocess.Popen(["flock", "--nonblock", str(lock), "sh", "-c", "echo held; exec cat"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for name in [n for n in os.environ if n == "TF_CONFIG" or n.startswith(("SLURM_", "MNIST_"))]:
            monkeypatch.delenv(name)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        # Were the lock not taken, the run would wait this long for workers that never come, then exit 138.
        status = train_mnist_mirrored.main(["--strategy", "multiworker", "--cluster-timeout", "5",
                                            "--output-dir", str(output_dir)])
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == exits.EXIT_BAD_INPUT and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {output_dir} is in use by another run (a run that has not yet said"), lines
    assert os.listdir(output_dir) == [lock.name]


@pytest.mark.parametrize("environ, rank", [
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
                               "task": {"type": "worker", "index": 0}})}, 1),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:2", "h:3"]}, "task": {"type": "worker", "index": 1}})}, 1),
    ({"JOB_COMPLETION_INDEX": "1", "MNIST_WORKERS": "2", "MNIST_WORKER_HOST": "job-{index}.workers",
      "MNIST_WORKER_PORT": "2222"}, 1),
], ids=["worker-0-beside-a-chief", "tf-config-worker-1", "indexed-job-pod-1"])
def test_only_rank_0_is_the_chief_that_locks(environ, rank):
    """TensorFlow's chief: the "chief" task where there is one, else worker 0; the others write elsewhere."""
    assert worker_sources.find(environ, "job-1").rank == rank


def test_a_file_system_without_locks_gets_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """NFS without its lock service raises ENOLCK; no file system here refuses locks, so flock is made to."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cfg = config.Config(output_dir=str(tmp_path / "out"))
    run_lock.take(cfg)
    run_lock.release()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "keeps no file locks" in lines[0], lines
    assert os.strerror(errno.ENOLCK) in lines[0] and "docs/faults.md" in lines[0]
    assert os.listdir(cfg.output_dir) == []  # no lock file that would say nothing true


def test_a_refused_run_that_made_the_folder_leaves_nothing(tmp_path, capsys):
    """The lock comes before checks that need TensorFlow; a run refused by one of them takes the folder away again."""
    output_dir = tmp_path / "new" / "out"
    status = train_mnist_mirrored.main(["--devices", "/gpu:7", "--output-dir", str(output_dir)])
    assert status == exits.EXIT_BAD_INPUT, capsys.readouterr().err
    assert os.listdir(tmp_path) == []
