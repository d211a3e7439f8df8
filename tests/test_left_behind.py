"""Nothing left behind: every temporary file of a run in one scratch folder per process, removed at every end
(machinery/scratch.py), the offline prepare included; a stop during start-up or the prepare says one line.

The slow test runs, with TMPDIR an empty folder, a prepare stopped by SIGTERM and one run to its end, and a run
interrupted by Ctrl-C while TensorFlow starts; afterwards TMPDIR is empty. Workers that share a node's TMPDIR, one
SIGKILLed or both pre-empted, then restarted to the end, leave it empty too and only the README's "Outputs" in
their folder: test_schedulers.py's TFJob that loses a worker and test_resize.py's two workers to one and back.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import prepare_mnist
from config import Config
from processes import EXIT_SECONDS, ROOT, Worker, finish, wait_until
from small_data import dataset_folder, make_split, write_idx_dir
from machinery import scratch
from machinery import sigterm
from machinery import terminal
from test_cluster_start import error_lines
from machinery import exits


# ---------------------------------------------------------------- the scratch folder, in this process

@pytest.fixture
def empty_tmpdir(tmp_path, monkeypatch):
    """TMPDIR an empty folder, and Python's temp dir read from it afresh."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return folder


def test_the_scratch_folder_holds_every_temporary_file_and_goes_with_the_block(empty_tmpdir):
    with scratch.kept("out worker 1") as path:
        assert os.path.dirname(path) == str(empty_tmpdir)
        assert tempfile.gettempdir() == path and os.environ["TMPDIR"] == path
        made = tempfile.mkdtemp(prefix="mnist-worker-")
        assert os.path.dirname(made) == path
    assert os.listdir(empty_tmpdir) == []
    assert os.environ["TMPDIR"] == str(empty_tmpdir) and tempfile.gettempdir() == str(empty_tmpdir)


def test_a_restart_empties_what_a_killed_process_left(empty_tmpdir):
    """A SIGKILLed process's folder has the same name; its files and folders go when the same key starts again."""
    stale = empty_tmpdir / scratch.name("out worker 1")
    (stale / "mnist-worker-x").mkdir(parents=True)
    (stale / "__autograph_generated_file1.py").write_text("")
    with scratch.kept("out worker 1") as path:
        assert path == str(stale)
        assert os.listdir(path) == [scratch.LOCK]
    assert os.listdir(empty_tmpdir) == []


def test_a_live_holder_keeps_its_folder_and_the_other_process_takes_its_own(empty_tmpdir):
    # The kernel's lock is per open file, so a second open in this process stands in for another process.
    with scratch.kept("out worker 1") as first:
        (empty_tmpdir / scratch.name("out worker 1") / "in-use").write_text("")
        with scratch.kept("out worker 1") as second:
            assert second != first and os.path.isdir(second)
        assert sorted(os.listdir(first)) == [scratch.LOCK, "in-use"]
    assert os.listdir(empty_tmpdir) == []


def test_the_ranks_of_one_output_folder_have_folders_of_their_own():
    names = {scratch.name(f"{folder} worker {rank}") for folder in ("/a", "/b") for rank in (0, 1)}
    assert len(names) == 4 and all(name.startswith(scratch.PREFIX) for name in names)


ENDED = """
import sys
from machinery import scratch
from machinery import sigterm

with scratch.kept("ended") as path:
    open(path + "/written", "w").close()
    print(path, flush=True)
    sigterm.end_process(143)
"""


def test_a_process_ended_from_inside_the_block_removes_its_folder(empty_tmpdir):
    """SIGTERM outside training ends the process from its own thread (sigterm.end_process): the block never ends."""
    proc = subprocess.run([sys.executable, "-c", ENDED], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(empty_tmpdir)}, timeout=EXIT_SECONDS)
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.strip().startswith(str(empty_tmpdir))
    assert os.listdir(empty_tmpdir) == []


def test_the_offline_mnist_prepare_leaves_no_temporary_folder(empty_tmpdir, idx_dir, tmp_path, capsys):
    """tfds's builder makes an empty tmp*tfds folder each time it looks for the dataset's metadata offline."""
    assert prepare_mnist.main(["--idx-dir", idx_dir, "--data-dir", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert os.listdir(empty_tmpdir) == []
    # Its progress, one closing line and how to train on it.
    assert out == [f"preparing {Config.dataset} in {tmp_path / 'data'} from the IDX files in {idx_dir}",
                   f"prepared {Config.dataset} in {dataset_folder(tmp_path / 'data')}",
                   f"train with: python train_mnist_mirrored.py --data-dir {tmp_path / 'data'}"]


# ---------------------------------------------------------------- held start-up lines and a stop

@pytest.mark.parametrize("stop", [KeyboardInterrupt, sigterm.Stopped])
def test_a_stop_during_start_up_drops_the_held_lines(stop, capfd):
    with pytest.raises(stop):
        with terminal.startup_output_held(verbose=False):
            os.write(2, f"{terminal.STARTUP_NOTICES[0]}\nI0000 other held line\n".encode())
            raise stop
    assert capfd.readouterr().err == ""


def test_a_failure_during_start_up_still_shows_the_held_lines(capfd):
    with pytest.raises(RuntimeError):
        with terminal.startup_output_held(verbose=False):
            os.write(2, b"I0000 what led to it\n")
            raise RuntimeError
    assert capfd.readouterr().err == "I0000 what led to it\n"


# ---------------------------------------------------------------- stops, with TMPDIR an empty folder

# Enough images that the prepare is still writing them when SIGTERM comes (seconds, on a loaded 2-core machine).
LARGE_PREPARE = 20_000


def holding(worker, text):
    """Whether `worker` holds back its standard error now (terminal.startup_output_held), and has held `text`."""
    fd2 = f"/proc/{worker.proc.pid}/fd/2"
    assert worker.proc.poll() is None, worker.stderr[-3000:]
    try:
        if os.path.samefile(fd2, worker.stderr_path):
            return False
        with open(fd2, errors="replace") as held:
            return text in held.read()
    except FileNotFoundError:
        return False


def one_error_line(worker):
    """The one line a stopped process wrote on stderr, beside tfds's progress bars if any."""
    errors = error_lines(worker.stderr)
    assert len(errors) == 1 and errors[0] == worker.last_stderr_line, worker.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_stopped_prepares_and_runs_keep_nothing(tmp_path):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {"TMPDIR": str(tmpdir)}  # every process's, as on one node
    rng = np.random.default_rng(5)

    # A prepare stopped by SIGTERM while it writes: 143, one line, no dataset.
    large_idx = write_idx_dir(tmp_path / "large_idx", {"train": make_split(LARGE_PREPARE, rng),
                                                       "test": make_split(64, rng)})
    stopped_data = tmp_path / "stopped_data"
    prepare = Worker(["--idx-dir", large_idx, "--data-dir", str(stopped_data)], env, tmp_path, "prepare_stopped",
                     script="prepare_mnist.py")
    def writing():  # into tfds's incomplete folder, renamed when whole
        assert prepare.proc.poll() is None, prepare.stderr[-3000:]
        return (stopped_data / Config.dataset).is_dir() and os.listdir(stopped_data / Config.dataset)
    try:
        wait_until(writing, "prepare writing")
        prepare.proc.terminate()
        finish([prepare], EXIT_SECONDS)
    finally:
        prepare.proc.kill()
    assert prepare.returncode == exits.EXIT_PREEMPTED, prepare.stderr[-3000:]
    assert one_error_line(prepare).startswith("error: stopped (SIGTERM); no half-written dataset was kept")
    assert os.listdir(stopped_data / Config.dataset) == []  # neither the dataset nor tfds's incomplete folder

    # A prepare to its end: its progress and one closing line on stdout, none of TensorFlow's start-up notices.
    idx = write_idx_dir(tmp_path / "idx", {"train": make_split(320, rng), "test": make_split(64, rng)})
    data_dir = str(tmp_path / "data")
    prepare = Worker(["--idx-dir", idx, "--data-dir", data_dir], env, tmp_path, "prepare", script="prepare_mnist.py")
    assert finish([prepare], 300) == [0], prepare.stderr[-3000:]
    assert [line for line in prepare.stdout.splitlines() if Config.dataset in line] == [
        f"preparing {Config.dataset} in {data_dir} from the IDX files in {idx}",
        f"prepared {Config.dataset} in {dataset_folder(data_dir)}",
        f"train with: python train_mnist_mirrored.py --data-dir {data_dir}"]
    assert not any(notice in prepare.stderr for notice in (*terminal.STARTUP_NOTICES, terminal.CUINIT_FAILED))

    # Ctrl-C while TensorFlow starts, its start-up lines held back: 130 and one line.
    interrupted_out = tmp_path / "interrupted"
    run = Worker(["--data-dir", data_dir, "--output-dir", str(interrupted_out)], env, tmp_path, "interrupted",
                 interruptible=True)
    try:
        wait_until(lambda: holding(run, terminal.STARTUP_NOTICES[0]), "start-up lines held back")
        run.interrupt()
        finish([run], EXIT_SECONDS)
    finally:
        run.proc.kill()
    assert run.returncode == exits.EXIT_INTERRUPTED, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and one_error_line(run).startswith("error: interrupted;"), run.stderr

    assert os.listdir(tmpdir) == []
    assert not interrupted_out.exists() or os.listdir(interrupted_out) == []
