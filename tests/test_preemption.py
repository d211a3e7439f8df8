"""Resume after a kill or a pre-emption: SIGTERM saves at the next step boundary and exits 143, a SIGKILL loses at
most --backup-every-steps steps (and leaves its lock behind, which blocks nothing), and either way the same command
resumes at the saved step, trains only what was missing (the learning-rate schedule where it was) and ends with the
weights of a run never interrupted, bit for bit: --deterministic reruns are bit-identical. One uninterrupted run of
each precision is the reference of every test here. SIGTERM to one of two workers is in test_resize.py, whose
workers then resume on another cluster size. Under bfloat16 mixed precision it is the same, to the bit, and so
under the default strategy (no distribution)."""

import os
import shutil
import signal
import time

import numpy as np
import pytest

from config import Config
from machinery import resume
from machinery.exits import EXIT_PREEMPTED
from processes import EXIT_SECONDS, Worker, finish, wait_until
from runs import final_weights, finished
from test_run_lock import described_by

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

EPOCHS = 4  # the schedule changes at epoch 4, so a resume that lost its epoch would show
BATCH = 8
STEPS = 1600 // BATCH  # the resume data's 1,600 training images: 200 steps an epoch, none of them short
EVERY = 20
FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
         "--backup-every-steps", str(EVERY), "--deterministic", "--seed", "7"]
# Each --mixed-precision choice resumed here: its flags, and the policy its results.json names.
PRECISIONS = {"float32": ([], "float32"), "bfloat16": (["--mixed-precision", "bfloat16"], "mixed_bfloat16")}


def _args(data_dir, output_dir, *extra):
    return [*FLAGS, "--data-dir", data_dir, "--output-dir", output_dir, *extra]


def _finish(data_dir, output_dir, *extra):
    """The command to its end (runs.finished): its stdout and results.json."""
    _, stdout, results = finished(_args(data_dir, output_dir, *extra), os.path.dirname(output_dir))
    return stdout, results


def _assert_resumed_inside_epoch_2(stdout, results):
    step = results["resumed_from_step"]
    assert STEPS < step < 2 * STEPS, step  # inside epoch 2, not at its start
    assert results["resumed_from_epoch"] == 1
    assert f"at epoch 2, image {(step - STEPS) * BATCH:,} of {STEPS * BATCH:,}\n" in stdout
    # It trained only what was missing, and counts only that.
    assert results["train_images"] == (EPOCHS * STEPS - step) * BATCH


class Reference:
    """A run never interrupted: its output folder and final weights."""

    def __init__(self, output_dir):
        self.output_dir = output_dir
        self.weights = final_weights(output_dir, EPOCHS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, resume_data_dir):
    """The run never interrupted, of a precision (a Reference): each run once, when a test first asks."""
    runs = {}

    def reference(precision):
        if precision not in runs:
            output_dir = str(tmp_path_factory.mktemp(f"uninterrupted_{precision}") / "out")
            flags, policy = PRECISIONS[precision]
            _, results = _finish(resume_data_dir, output_dir, *flags)
            assert results["resumed_from_step"] == 0 and results["train_images"] == EPOCHS * STEPS * BATCH
            assert results["dtype_policy"] == policy
            assert not os.path.exists(os.path.join(output_dir, "backup"))  # removed as the run ended
            runs[precision] = Reference(output_dir)
        return runs[precision]

    return reference


def _assert_bit_identical(output_dir, reference):
    """The final weights of the run in `output_dir` are the reference's, bit for bit: a --deterministic rerun,
    resumed or not, is bit-identical."""
    got, expected = final_weights(output_dir, EPOCHS), reference.weights
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


# A run in bfloat16 resumes as one in float32 does, to the bit: its backup holds the same float32 weights and Adam
# slots.
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_sigterm_saves_exits_143_and_resumes_bit_identical(precision, tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    flags, policy = PRECISIONS[precision]
    proc = Worker(_args(resume_data_dir, output_dir, *flags), {}, tmp_path, "run")
    try:
        proc.wait_for(f"Epoch 2/{EPOCHS}")
        sent = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        finish([proc], timeout=EXIT_SECONDS)
        exit_seconds = time.monotonic() - sent
    finally:
        proc.proc.kill()
    err = proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert exit_seconds < EXIT_SECONDS
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: pre-empted (SIGTERM)") and "run the same command again" in last, last
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(output_dir, "results.json"))
    # The backup holds a step inside epoch 2, the one the message names.
    position = resume.read(os.path.join(output_dir, "backup"))
    epoch, step = position.epoch, position.image // BATCH
    assert epoch == 1 and 0 < step < STEPS
    assert f"saved at epoch 2, image {position.image:,} of {STEPS * BATCH:,};" in last

    resumed_stdout, results = _finish(resume_data_dir, output_dir, *flags)
    assert results["resumed_from_step"] == STEPS + step and results["strategy"] == "mirrored"
    assert results["dtype_policy"] == policy
    _assert_resumed_inside_epoch_2(resumed_stdout, results)
    _assert_bit_identical(output_dir, uninterrupted(precision))


# Under the default strategy (no distribution), which backs up and resumes as MirroredStrategy on one device does,
# to the bit: the reference is the mirrored run's.
def test_sigkill_mid_epoch_resumes_at_the_last_backup_bit_identical(tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    backup_dir = os.path.join(output_dir, "backup")
    worker = Worker(_args(resume_data_dir, output_dir, "--strategy", "default"), {}, tmp_path, "run")
    proc = worker.proc
    try:
        worker.wait_for(f"Epoch 2/{EPOCHS}")

        def inside_epoch_2():
            assert proc.poll() is None, "the run ended before a backup inside epoch 2"
            try:
                backed_up = resume.read(backup_dir)
            except Exception:  # noqa: BLE001 - the checkpoint being replaced while read; look again
                return None
            if backed_up is not None and backed_up.epoch == 1 and backed_up.image // BATCH:
                return backed_up.epoch, backed_up.image // BATCH
            return None
        position = wait_until(inside_epoch_2, "backup inside epoch 2")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=EXIT_SECONDS)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert position[1] % EVERY == 0  # backups fall every --backup-every-steps steps
    assert not os.path.exists(os.path.join(output_dir, "results.json"))
    lock = os.path.join(output_dir, Config().lock_file)
    assert described_by(lock, proc.pid)  # left behind, still naming the dead run: it blocks nothing

    resumed_stdout, results = _finish(resume_data_dir, output_dir, "--strategy", "default")
    _assert_resumed_inside_epoch_2(resumed_stdout, results)
    assert results["strategy"] == "default"
    assert results["resumed_from_step"] >= STEPS + position[1]  # at the backup seen, or a later one
    # It trains epoch 2's rest and the epochs after it, each once, the schedule where it was: epoch 4 at 1e-4.
    trained = [n for n in range(1, EPOCHS + 1) if f"Epoch {n}/{EPOCHS}" in resumed_stdout]
    assert trained == list(range(2, EPOCHS + 1)), trained
    assert f"Learning rate for epoch {EPOCHS} is 1e-04\n" in resumed_stdout
    _assert_bit_identical(output_dir, uninterrupted("float32"))
    assert not os.path.exists(backup_dir)  # removed once the run ended
    assert not os.path.exists(lock)


def test_overwrite_replaces_a_finished_run_without_mixing_checkpoints(tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    shutil.copytree(uninterrupted("float32").output_dir, output_dir)
    assert os.path.exists(os.path.join(output_dir, "training_checkpoints", f"ckpt_{EPOCHS}.index"))
    _, _, results = finished(["--epochs", "1", "--steps-per-epoch", "5", "--data-dir", resume_data_dir,
                              "--output-dir", output_dir, "--overwrite"], tmp_path)
    assert results["epochs"] == 1 and results["resumed_from_epoch"] == 0
    # Only the new run's checkpoint is left: none of the old run's four survive beside it.
    names = sorted(os.listdir(os.path.join(output_dir, "training_checkpoints")))
    assert names == ["checkpoint", "ckpt_1.data-00000-of-00001", "ckpt_1.index"]
