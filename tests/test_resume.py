"""A killed run resumes where it stopped and ends where an uninterrupted run ends; reruns are bit-identical."""

import json
import os
import signal

import numpy as np
import pytest

from processes import Worker, finish, run_entrypoint
from runs import final_weights

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

EPOCHS = 4
# Enough steps that an epoch lasts long enough to be killed inside it.
RESUME_FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", "8", "--steps-per-execution", "1",
                "--deterministic", "--seed", "7"]


def _args(data_dir, output_dir):
    return [*RESUME_FLAGS, "--data-dir", data_dir, "--output-dir", output_dir]


def _run(data_dir, output_dir):
    proc = run_entrypoint(_args(data_dir, output_dir), os.path.dirname(output_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _final_weights(output_dir):
    return final_weights(output_dir, EPOCHS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, resume_data_dir):
    output_dir = str(tmp_path_factory.mktemp("uninterrupted") / "out")
    _run(resume_data_dir, output_dir)
    return output_dir


def test_identical_runs_give_bit_identical_weights(tmp_path, resume_data_dir, uninterrupted):
    again = str(tmp_path / "again")
    _run(resume_data_dir, again)
    first, second = _final_weights(uninterrupted), _final_weights(again)
    assert first.keys() == second.keys()
    for name in first:
        assert np.array_equal(first[name], second[name]), name


def test_killed_run_resumes_and_matches_uninterrupted(tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    worker = Worker(_args(resume_data_dir, output_dir), {}, tmp_path, "killed")
    try:
        worker.wait_for(f"Epoch 3/{EPOCHS}")  # epochs 1 and 2 are done and backed up
        worker.proc.send_signal(signal.SIGKILL)
    finally:
        finish([worker])
    assert worker.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(output_dir, "results.json"))
    assert os.path.isdir(os.path.join(output_dir, "backup"))

    resumed = _run(resume_data_dir, output_dir)
    results = json.loads(open(os.path.join(output_dir, "results.json")).read())
    first = results["resumed_from_epoch"]
    assert first >= 2
    # It trained only the epochs that were missing, and says so.
    trained = [n for n in range(1, EPOCHS + 1) if f"Epoch {n}/{EPOCHS}" in resumed.stdout]
    assert trained == list(range(first + 1, EPOCHS + 1))
    assert results["train_images"] == (EPOCHS - first) * results["steps_per_epoch"] * results["global_batch_size"]
    # The learning-rate schedule continues where it was: epoch 4 runs at 1e-4.
    assert f"Learning rate for epoch {EPOCHS} is 1e-04\n" in resumed.stdout
    # Same weights as the run that was never killed, and no backup left behind.
    expected, got = _final_weights(uninterrupted), _final_weights(output_dir)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not os.path.exists(os.path.join(output_dir, "backup"))
    assert not os.path.exists(os.path.join(uninterrupted, "backup"))


def test_overwrite_replaces_a_finished_run_without_mixing_checkpoints(tmp_path, resume_data_dir, uninterrupted):
    import shutil

    output_dir = str(tmp_path / "out")
    shutil.copytree(uninterrupted, output_dir)
    assert os.path.exists(os.path.join(output_dir, "training_checkpoints", f"ckpt_{EPOCHS}.index"))
    proc = run_entrypoint(["--epochs", "1", "--steps-per-epoch", "5", "--data-dir", resume_data_dir,
                           "--output-dir", output_dir, "--overwrite"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(open(os.path.join(output_dir, "results.json")).read())
    assert results["epochs"] == 1 and results["resumed_from_epoch"] == 0
    # Only the new run's checkpoint is left: none of the old run's four survive beside it.
    names = sorted(os.listdir(os.path.join(output_dir, "training_checkpoints")))
    assert names == ["checkpoint", "ckpt_1.data-00000-of-00001", "ckpt_1.index"]
