"""Pre-emption and mid-epoch resume: SIGTERM saves at the next step boundary and exits 143, a SIGKILL loses at
most --backup-every-steps steps, and either way the same command resumes at the saved step and ends with the
weights of a run never interrupted, bit for bit."""

import json
import os
import signal
import time

import numpy as np
import pytest

import callbacks
import data
from config import EXIT_PREEMPTED
from conftest import Worker, final_weights, finish, free_ports, run_entrypoint

EPOCHS = 3
BATCH = 8
STEPS = 1600 // BATCH  # the resume data's 1,600 training images: 200 steps an epoch, none of them short
EVERY = 20
FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
         "--backup-every-steps", str(EVERY), "--deterministic", "--seed", "7"]
EXIT_SECONDS = 60  # a generous bound for "well inside Kubernetes's 30 s grace period" on a loaded test machine


def _args(data_dir, output_dir, *extra):
    return [*FLAGS, "--data-dir", data_dir, "--output-dir", output_dir, *extra]


def _finish(data_dir, output_dir):
    proc = run_entrypoint(_args(data_dir, output_dir), os.path.dirname(output_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(output_dir, "results.json")) as f:
        return proc, json.load(f)


def _assert_resumed_inside_epoch_2(proc, results):
    step = results["resumed_from_step"]
    assert STEPS < step < 2 * STEPS, step  # inside epoch 2, not at its start
    assert results["resumed_from_epoch"] == 1
    assert f"at epoch 2, step {step - STEPS}" in proc.stdout
    # It trained only what was missing, and counts only that.
    assert results["train_images"] == (EPOCHS * STEPS - step) * BATCH


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, resume_data_dir):
    output_dir = str(tmp_path_factory.mktemp("preempt_uninterrupted") / "out")
    _, results = _finish(resume_data_dir, output_dir)
    assert results["resumed_from_step"] == 0 and results["train_images"] == EPOCHS * STEPS * BATCH
    return final_weights(output_dir, EPOCHS)


def _assert_bit_identical(output_dir, expected):
    got = final_weights(output_dir, EPOCHS)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_sigterm_saves_exits_143_and_resumes_bit_identical(tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    proc = Worker(_args(resume_data_dir, output_dir), {}, tmp_path, "run")
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
    epoch, step = callbacks.backed_up_position(os.path.join(output_dir, "backup"), STEPS)
    assert epoch == 1 and 0 < step < STEPS
    assert f"global step {STEPS + step})" in last

    resumed, results = _finish(resume_data_dir, output_dir)
    assert results["resumed_from_step"] == STEPS + step
    _assert_resumed_inside_epoch_2(resumed, results)
    _assert_bit_identical(output_dir, uninterrupted)


def test_sigkill_mid_epoch_resumes_at_the_last_backup_bit_identical(tmp_path, resume_data_dir, uninterrupted):
    output_dir = str(tmp_path / "out")
    backup_dir = os.path.join(output_dir, "backup")
    worker = Worker(_args(resume_data_dir, output_dir), {}, tmp_path, "run")
    proc = worker.proc
    try:
        worker.wait_for(f"Epoch 2/{EPOCHS}")
        position = (0, 0)
        while position[0] != 1 or position[1] == 0:  # until a backup inside epoch 2 is written
            assert proc.poll() is None, "the run ended before a backup inside epoch 2"
            try:
                position = callbacks.backed_up_position(backup_dir, STEPS)
            except Exception:  # noqa: BLE001 - the checkpoint being replaced while read; look again
                pass
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert position[1] % EVERY == 0  # backups fall every --backup-every-steps steps

    resumed, results = _finish(resume_data_dir, output_dir)
    _assert_resumed_inside_epoch_2(resumed, results)
    assert results["resumed_from_step"] >= STEPS + position[1]  # at the backup seen, or a later one
    _assert_bit_identical(output_dir, uninterrupted)


def test_sigterm_to_one_of_two_workers_stops_both_with_143(tmp_path, resume_data_dir):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    output_dir = str(tmp_path / "out")

    def start_workers(attempt):
        return [Worker(_args(resume_data_dir, output_dir, "--strategy", "multiworker"),
                       {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})},
                       tmp_path, f"worker{index}-{attempt}")
                for index in range(2)]

    workers = start_workers(1)
    try:
        workers[0].wait_for(f"Epoch 2/{EPOCHS}")
        workers[1].proc.send_signal(signal.SIGTERM)  # the non-chief: the chief learns of it through the all-reduce
        exits = _exit_seconds(workers, since=time.monotonic())
    finally:
        finish(workers, timeout=EXIT_SECONDS)
    # The workers leave together (within 5 s of the first, asked; 16-22 s apart before they left without
    # TensorFlow's teardown); the bound here is only a generous guard for a loaded machine.
    print(f"SIGTERM to worker 1 of 2: exits {exits[0]:.2f} s and {exits[1]:.2f} s after it")
    assert abs(exits[0] - exits[1]) < EXIT_SECONDS / 4
    errors = [w.stderr for w in workers]
    for w, err in zip(workers, errors):
        assert w.returncode == EXIT_PREEMPTED, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("error: pre-empted (SIGTERM)")
    # Both stopped at the same step: the one the chief saved and both name.
    global_batch = 2 * BATCH
    steps = 1600 // global_batch
    epoch, step = callbacks.backed_up_position(os.path.join(output_dir, "backup"), steps)
    assert epoch == 1 and 0 < step < steps
    for err in errors:
        assert f"(global step {steps + step})" in err

    workers = start_workers(2)
    finish(workers, timeout=600)
    for w in workers:
        assert w.returncode == 0, w.stderr[-3000:]
    with open(os.path.join(output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["resumed_from_step"] == steps + step and results["replicas"] == 2


def _exit_seconds(workers, since):
    """Seconds from `since` to each worker's exit (EXIT_SECONDS for one still running then)."""
    exits = [None] * len(workers)
    while None in exits and time.monotonic() - since < EXIT_SECONDS:
        for i, w in enumerate(workers):
            if exits[i] is None and w.proc.poll() is not None:
                exits[i] = time.monotonic() - since
        time.sleep(0.05)
    return [EXIT_SECONDS if e is None else e for e in exits]


def test_images_in_steps_counts_each_epochs_short_last_batch():
    # 1,000 images in batches of 64: 16 steps an epoch, the last holding 40.
    assert data.images_in_steps(0, 16, 16, 64, 1000) == 1000
    assert data.images_in_steps(0, 32, 16, 64, 1000) == 2000
    assert data.images_in_steps(10, 20, 16, 64, 1000) == 9 * 64 + 40
    assert data.images_in_steps(16, 20, 16, 64, 1000) == 4 * 64
