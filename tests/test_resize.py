"""A run restarted on another cluster size continues exactly, counted in images: 1 replica to 2 and back to 1, 2
workers to 1 and back to 2, interrupted by SIGTERM or SIGKILL mid-epoch, the resized runs too. Every training
image of each epoch is trained exactly once across the processes, the counts add up, and the learning rate
stays on the epochs' schedule; workers pre-empted and restarted leave nothing in their node's TMPDIR. A restart the
backup's position cannot survive is refused, the backup kept."""

import hashlib
import json
import os
import re
import signal
import time

import numpy as np
import pytest
import tensorflow as tf

import callbacks
from machinery import input_engine
from machinery import resume
import train_mnist_mirrored
from config import Config
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED, UsageError
from processes import EXIT_SECONDS, WAIT_SECONDS, Worker, finish, free_ports
from runs import assert_only_documented_outputs
from test_multi_gpu_options import expected_rate

NUM_TRAIN = 1600  # conftest.resume_data_dir's training split
EPOCHS = 2
BATCH = 16  # per replica: 100 steps an epoch on one replica, 50 on two
SEED = 7
BUFFER = Config().buffer_size
FLAGS = ["--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
         "--backup-every-steps", "10", "--seed", str(SEED)]


def _start(tmp_path, name, data_dir, output_dir, *extra, env=None, epochs=EPOCHS):
    args = ["--epochs", str(epochs), *FLAGS, "--data-dir", data_dir, "--output-dir", output_dir, *extra]
    return Worker(args, env or {}, tmp_path, name)


def _workers(tmp_path, name, data_dir, output_dir, count, env=None):
    """`count` multi-worker processes on loopback, on ports of their own; `env`: more of their environment."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(count)]}
    return [_start(tmp_path, f"{name}{index}", data_dir, output_dir, "--strategy", "multiworker",
                   env={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                        **(env or {})})
            for index in range(count)]


def _wait_for_backup(worker, backup_dir, wanted):
    """The first backed-up position `wanted` accepts, read while the run goes on."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        assert worker.proc.poll() is None, f"it ended before such a backup: {worker.stderr[-3000:]}"
        assert time.monotonic() < deadline, f"no such backup after {WAIT_SECONDS} s"
        try:
            position = resume.read(backup_dir)
        except Exception:  # noqa: BLE001 - the checkpoint being replaced while read; look again
            position = None
        if position is not None and wanted(position):
            return position
        time.sleep(0.05)


def _preempted(workers):
    for worker, rc in zip(workers, finish(workers, timeout=EXIT_SECONDS)):
        assert rc == EXIT_PREEMPTED, worker.stderr[-3000:]
        assert worker.last_stderr_line.startswith("error: pre-empted (SIGTERM)"), worker.stderr[-3000:]
        assert "Traceback" not in worker.stderr


def _exit_seconds(workers, since):
    """Seconds from `since` to each worker's exit (EXIT_SECONDS for one still running by then)."""
    exits = [None] * len(workers)
    while None in exits and time.monotonic() - since < EXIT_SECONDS:
        for i, worker in enumerate(workers):
            if exits[i] is None and worker.proc.poll() is not None:
                exits[i] = time.monotonic() - since
        time.sleep(0.05)
    return [EXIT_SECONDS if e is None else e for e in exits]


def _finished(workers, output_dir):
    for worker, rc in zip(workers, finish(workers, timeout=WAIT_SECONDS)):
        assert rc == EXIT_OK, worker.stderr[-3000:]
    with open(os.path.join(output_dir, "results.json")) as f:
        return json.load(f)


def _trained(position):
    return position.epoch * NUM_TRAIN + position.image


def _assert_resumed_at(worker, position, now_batch):
    """The restart says where it resumes, in images, and that the global batch changed."""
    line = (f"at epoch {position.epoch + 1}, image {position.image:,} of {NUM_TRAIN:,} (backed up at global batch "
            f"{position.settings.global_batch}, now {now_batch})")
    assert line in worker.stdout, worker.stdout[-3000:]


def _tutorial_order(num_examples, epoch):
    """An epoch's order of the split's indices by the tutorial's shuffle, seeded as the project seeds each epoch."""
    order = tf.data.Dataset.range(num_examples).shuffle(BUFFER, seed=SEED + epoch, reshuffle_each_iteration=False)
    return list(order.as_numpy_iterator())


def _assert_each_image_once(segments):
    """`segments`: for each process in turn, (first position, last position, global batch). Rebuilds from
    input_engine.index_batches the batches each process trained and checks, epoch by epoch, that together they are
    that epoch's seeded order: every training image once, none skipped, none twice."""
    trained = {epoch: [] for epoch in range(EPOCHS)}
    for (first_epoch, first_image), (last_epoch, last_image), batch in segments:
        for epoch in range(first_epoch, last_epoch + (1 if last_image else 0)):
            start = first_image if epoch == first_epoch else 0
            stop = last_image if epoch == last_epoch else NUM_TRAIN
            batches = [indices for indices, _ in input_engine.index_batches(input_engine.Stream(
                num_examples=NUM_TRAIN, global_batch=batch, buffer_size=BUFFER, seed=SEED, epochs=epoch + 1,
                first_epoch=epoch, first_image=start)).as_numpy_iterator()]
            sizes = [len(b) for b in batches]
            assert all(size == batch for size in sizes[:-1]) and 0 < sizes[-1] <= batch  # only the last is short
            # The process stopped after a whole batch: its backup falls on a batch boundary of its own.
            images = np.concatenate(batches)[:stop - start]
            assert stop == NUM_TRAIN or (stop - start) % batch == 0
            trained[epoch].extend(images.tolist())
    for epoch, images in trained.items():
        order = _tutorial_order(NUM_TRAIN, epoch)
        assert sorted(images) == list(range(NUM_TRAIN)), f"epoch {epoch + 1}"
        assert images == order, f"epoch {epoch + 1}"


def _rates(stdout):
    return {int(m[1]): float(m[2]) for m in re.finditer(r"Learning rate for epoch (\d+) is (\S+)", stdout)}


def _assert_rates_on_schedule(stdout, *, global_batch, scale_lr, warmup_epochs=0):
    """Each epoch's printed rate is what an uninterrupted run at this global batch applies at that epoch's end."""
    steps = input_engine.steps_per_epoch(NUM_TRAIN, global_batch)
    scale = callbacks.learning_rate_scale(global_batch, scale_lr)
    for epoch, rate in _rates(stdout).items():
        assert rate == pytest.approx(expected_rate(epoch * steps - 1, steps_per_epoch=steps, scale=scale,
                                                   warmup_epochs=warmup_epochs), rel=1e-6), epoch


# ---------------------------------------------------------------- the arithmetic, by hand

def _settings(global_batch, num_examples=1000, steps_per_epoch=None):
    return resume.Settings(num_examples=num_examples, seed=SEED, buffer_size=BUFFER, steps_per_epoch=steps_per_epoch,
                           global_batch=global_batch, scale_lr=False, warmup_epochs=0)


def test_a_resized_plan_finishes_the_epoch_in_images():
    # 1,000 images; backed up at global batch 8 after 200 images of epoch 2, resumed at 64 (16 steps an epoch,
    # the last holding 40).
    backed_up = resume.Position(epoch=1, image=200, optimizer_step=125 + 25, settings=_settings(8))
    plan = resume.Plan.resuming(backed_up, _settings(64))
    assert plan.steps == 16 and plan.epoch_images == 1000
    assert plan.first_step == 16 - 13  # the other 800 images take 13 steps, the last holding 32
    assert plan.first_global_step == 16 + 3 and plan.step_offset == 19 - 150
    assert plan.resumed_after_images == 1200 and plan.train_images(3) == 1800
    assert plan.images_done(1, 3) == 264 and plan.images_done(1, 14) == 968
    assert plan.position(1, 15, 163) == resume.Position(2, 0, 163, _settings(64))  # the epoch's end: the next one
    assert plan.position(2, 0, 164) == resume.Position(2, 64, 164, _settings(64))
    assert plan.position(2, 15, 179).epoch == 3
    assert "image 200 of 1,000 (backed up at global batch 8, now 64)" in plan.describe()
    # The position round-trips through the record the backup holds.
    assert resume.Position.from_json(backed_up.to_json()) == backed_up


def test_the_resumed_stream_is_the_rest_of_the_epochs_order_then_whole_epochs():
    plan = resume.Plan.resuming(resume.Position(1, 200, 150, _settings(8)), _settings(64))
    batches = list(input_engine.index_batches(plan.stream(3)).as_numpy_iterator())
    rest, after = batches[:plan.steps - plan.first_step], batches[plan.steps - plan.first_step:]
    assert [epoch for _, epoch in rest] == [1] * 13 and [epoch for _, epoch in after] == [2] * 16
    rest, after = [indices for indices, _ in rest], [indices for indices, _ in after]
    assert [len(b) for b in rest] == [64] * 12 + [32] and [len(b) for b in after] == [64] * 15 + [40]
    order = [_tutorial_order(1000, e) for e in (1, 2)]
    assert np.concatenate(rest).tolist() == order[0][200:]
    assert np.concatenate(after).tolist() == order[1]


def test_the_scaled_decay_counts_this_runs_epochs_not_the_optimizers_steps():
    # Resumed as above: the optimizer has taken 150 steps, this run's numbering starts at 19, 16 steps an epoch.
    plan = resume.Plan.resuming(resume.Position(1, 200, 150, _settings(8)), _settings(64))
    rate = callbacks.learning_rate(Config(scale_lr=True), global_batch=64, steps_per_epoch=plan.steps,
                                   step_offset=plan.step_offset)
    boundary = Config().lr_boundaries[0]  # 1e-3 before epoch 3 (0-based), 1e-4 from it
    last_of_epoch_2 = plan.optimizer_step + (boundary * plan.steps - 1 - plan.first_global_step)
    assert float(rate(last_of_epoch_2)) == pytest.approx(1e-3, rel=1e-6)
    assert float(rate(last_of_epoch_2 + 1)) == pytest.approx(1e-4, rel=1e-6)


def test_a_backup_without_a_record_is_refused_not_guessed(tmp_path):
    import tensorflow as tf

    # A backup as Keras alone writes it: its counters are steps of a global batch it does not name.
    checkpoint = tf.train.Checkpoint(ckpt_saved_epoch=tf.Variable(1, dtype=tf.int64),
                                     ckpt_saved_batch=tf.Variable(449, dtype=tf.int64))
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "backup" / resume.CHIEF_BACKUP), max_to_keep=1).save()
    with pytest.raises(UsageError, match="does not record what its position means.*--overwrite"):
        resume.read(str(tmp_path / "backup"))
    assert resume.read(str(tmp_path / "none")) is None


@pytest.mark.slow
def test_one_replica_to_two_killed_and_back_to_one_keeps_the_warmup_on_epochs(tmp_path, resume_data_dir):
    output_dir = str(tmp_path / "out")
    backup_dir = os.path.join(output_dir, "backup")
    scaled = ["--scale-lr", "--warmup-epochs", "2"]

    # One replica (global batch 16), pre-empted inside epoch 2.
    (one,) = [_start(tmp_path, "one", resume_data_dir, output_dir, *scaled)]
    one.wait_for(f"Epoch 2/{EPOCHS}")
    one.proc.send_signal(signal.SIGTERM)
    _preempted([one])
    first = resume.read(backup_dir)
    assert first.epoch == 1 and 0 < first.image < NUM_TRAIN and first.settings.global_batch == BATCH
    assert f"saved at epoch 2, image {first.image:,} of {NUM_TRAIN:,}" in one.last_stderr_line

    # Two replicas (global batch 32) go on from there, and are killed after a backup of their own.
    two = _start(tmp_path, "two", resume_data_dir, output_dir, "--cpu-replicas", "2", *scaled)
    second = _wait_for_backup(two, backup_dir, lambda p: _trained(p) > _trained(first))
    two.proc.send_signal(signal.SIGKILL)
    two.proc.wait(timeout=EXIT_SECONDS)
    second = resume.read(backup_dir)  # the last one it wrote
    assert second.epoch == 1 and second.settings.global_batch == 2 * BATCH
    _assert_resumed_at(two, first, 2 * BATCH)

    # One replica again finishes, from the two replicas' backup.
    (again,) = workers = [_start(tmp_path, "again", resume_data_dir, output_dir, *scaled)]
    results = _finished(workers, output_dir)
    _assert_resumed_at(again, second, BATCH)
    assert results["resumed_after_images"] == _trained(second)
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * NUM_TRAIN
    assert results["global_batch_size"] == BATCH and results["learning_rate_scale"] == 0.25
    _assert_each_image_once([((0, 0), (first.epoch, first.image), BATCH),
                             ((first.epoch, first.image), (second.epoch, second.image), 2 * BATCH),
                             ((second.epoch, second.image), (EPOCHS, 0), BATCH)])
    # The scale follows the new global batch, and epoch 2 ends mid-ramp at the ramp's point of a run that always
    # had one replica: the optimizer's step count (100 steps an epoch, 50 while there were two replicas) would put
    # it elsewhere.
    assert sorted(_rates(again.stdout)) == [2]
    for worker, global_batch in ((two, 2 * BATCH), (again, BATCH)):
        _assert_rates_on_schedule(worker.stdout, global_batch=global_batch, scale_lr=True, warmup_epochs=2)


@pytest.mark.slow
def test_two_workers_to_one_and_back_to_two(tmp_path, resume_data_dir):
    output_dir = str(tmp_path / "out")
    backup_dir = os.path.join(output_dir, "backup")
    node = {"TMPDIR": str(tmp_path / "tmpdir")}  # every process's, as on one node
    os.mkdir(node["TMPDIR"])

    # Two workers (global batch 32); the non-chief is pre-empted inside epoch 2, and the chief learns of it
    # through the all-reduce: both save at the same step, name it, and exit 143.
    workers = _workers(tmp_path, "pair", resume_data_dir, output_dir, 2, env=node)
    workers[0].wait_for(f"Epoch 2/{EPOCHS}")
    workers[1].proc.send_signal(signal.SIGTERM)
    exits = _exit_seconds(workers, since=time.monotonic())
    # They leave together (asked: within 5 s of the first; docs/clusters.md, "Leaving together", has what they
    # took before they left without TensorFlow's teardown); the bound is only a generous guard for a loaded machine.
    print(f"SIGTERM to worker 1 of 2: exits {exits[0]:.2f} s and {exits[1]:.2f} s after it")
    assert abs(exits[0] - exits[1]) < EXIT_SECONDS / 4
    _preempted(workers)
    first = resume.read(backup_dir)
    assert first.epoch == 1 and 0 < first.image < NUM_TRAIN and first.settings.global_batch == 2 * BATCH
    for worker in workers:
        assert f"saved at epoch 2, image {first.image:,} of {NUM_TRAIN:,};" in worker.last_stderr_line

    # One worker (global batch 16) goes on, and is pre-empted once it has backed up some of its own.
    (single,) = workers = _workers(tmp_path, "single", resume_data_dir, output_dir, 1, env=node)
    _wait_for_backup(single, backup_dir, lambda p: _trained(p) > _trained(first))
    single.proc.send_signal(signal.SIGTERM)
    _preempted(workers)
    _assert_resumed_at(single, first, BATCH)
    second = resume.read(backup_dir)
    assert second.settings.global_batch == BATCH and _trained(second) < EPOCHS * NUM_TRAIN

    # Two workers again finish the run.
    workers = _workers(tmp_path, "again", resume_data_dir, output_dir, 2, env=node)
    results = _finished(workers, output_dir)
    assert results["replicas"] == 2
    for worker in workers:
        _assert_resumed_at(worker, second, 2 * BATCH)
    assert results["resumed_after_images"] == _trained(second)
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * NUM_TRAIN
    _assert_each_image_once([((0, 0), (first.epoch, first.image), 2 * BATCH),
                             ((first.epoch, first.image), (second.epoch, second.image), BATCH),
                             ((second.epoch, second.image), (EPOCHS, 0), 2 * BATCH)])
    # Without --scale-lr, the tutorial's schedule by epoch number, whatever the global batch.
    _assert_rates_on_schedule(single.stdout, global_batch=BATCH, scale_lr=False)
    for worker in workers:
        assert sorted(_rates(worker.stdout)) == [EPOCHS]
        _assert_rates_on_schedule(worker.stdout, global_batch=2 * BATCH, scale_lr=False)
    # Pre-empted twice and finished: nothing left in the node's TMPDIR, only the documented outputs in the folder.
    assert os.listdir(node["TMPDIR"]) == []
    assert_only_documented_outputs(output_dir)


# ---------------------------------------------------------------- what a restart may not change

REFUSAL_EPOCHS = 12
REFUSAL_STEPS = 20  # --steps-per-epoch: an epoch of 320 images at global batch 16


def _digest(directory):
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            digest.update(path.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, resume_data_dir):
    """An unfinished run's outputs: pre-empted early, with --steps-per-epoch."""
    tmp_path = tmp_path_factory.mktemp("refusals")
    output_dir = str(tmp_path / "out")
    args = ["--steps-per-epoch", str(REFUSAL_STEPS)]
    (run,) = [_start(tmp_path, "first", resume_data_dir, output_dir, *args, epochs=REFUSAL_EPOCHS)]
    run.wait_for(f"Epoch 2/{REFUSAL_EPOCHS}")
    run.proc.send_signal(signal.SIGTERM)
    _preempted([run])
    return tmp_path, output_dir, args


def _args(data_dir, output_dir, args, *changed):
    return ["--epochs", str(REFUSAL_EPOCHS), *FLAGS, "--data-dir", data_dir, "--output-dir", output_dir, *args, *changed]


@pytest.mark.parametrize("changed, named", [
    (["--seed", "8"], f"with --seed {SEED}"),
    (["--buffer-size", "5000"], f"with --buffer-size {BUFFER}"),
    (["--steps-per-epoch", "10"], f"with --steps-per-epoch {REFUSAL_STEPS}"),
    (["--scale-lr"], "without --scale-lr"),
    (["--batch-size-per-replica", "8"], f"at global batch {BATCH}"),
    (["--epochs", "1"], "--epochs "),
    ([], "1,600"),  # another dataset: small_data's small one
], ids=["seed", "buffer-size", "steps-per-epoch", "scale-lr", "epoch-length", "epochs", "dataset"])
@pytest.mark.slow
def test_a_change_the_position_cannot_survive_is_refused(interrupted, resume_data_dir, data_dir, changed, named,
                                                         monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    _, output_dir, args = interrupted
    position = resume.read(os.path.join(output_dir, "backup"))
    before = _digest(output_dir)
    data_for_run = data_dir if not changed else resume_data_dir
    # argparse keeps the last of a flag given twice, so `changed` overrides `args`.
    rc = train_mnist_mirrored.main(_args(data_for_run, output_dir, args, *changed))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    assert named in err[0] and "--overwrite" in err[0], err[0]
    if changed[:1] == ["--epochs"]:
        least = position.epoch + (1 if position.image else 0)
        assert f"--epochs {least} or more" in err[0]
    assert _digest(output_dir) == before  # the backup, byte for byte, and nothing else written


@pytest.mark.slow
def test_after_refusals_the_command_with_more_epochs_resumes(interrupted, resume_data_dir):
    tmp_path, output_dir, args = interrupted
    position = resume.read(os.path.join(output_dir, "backup"))
    epochs = REFUSAL_EPOCHS + 1  # raising --epochs continues the run
    (run,) = workers = [_start(tmp_path, "resumed", resume_data_dir, output_dir, *args, epochs=epochs)]
    results = _finished(workers, output_dir)
    epoch_images = REFUSAL_STEPS * BATCH
    assert results["resumed_after_images"] == position.epoch * epoch_images + position.image > 0
    assert results["resumed_after_images"] + results["train_images"] == epochs * epoch_images
    assert f"Epoch {epochs}/{epochs}" in run.stdout
