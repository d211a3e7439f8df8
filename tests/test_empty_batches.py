"""No replica ever gets an empty training batch: TensorFlow 2.21's oneDNN MaxPoolGrad aborts the process on one
on some CPUs. A global batch smaller than the replica count is padded with examples of weight 0 (input_engine.padded);
every image is still trained once an epoch, each step's update is that of its real examples, and runs whose
last global batch holds one example finish: on two logical CPU replicas after a resize-resume whose rest of
the epoch is one image, and on two workers."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf

from machinery import input_engine
from machinery.exits import EXIT_OK, EXIT_PREEMPTED
from processes import ROOT, Worker, finish, free_ports, images_at, subprocess_env
from runs import max_abs_diff
from small_data import cached_split, make_split, write_dataset

REPRODUCER = os.path.join(ROOT, "docs", "upstream", "empty_batch_maxpoolgrad.py")
TESTS = os.path.join(ROOT, "tests")  # on the scripts' path, for small_data.cached_split
NUM_TRAIN = 17  # one more than a global batch of 16, or four of 4: every epoch ends with a batch of one example
EPOCHS = 2


@pytest.fixture(scope="module")
def odd_data_dir(tmp_path_factory):
    rng = np.random.default_rng(17)
    return write_dataset(tmp_path_factory.mktemp("tfds_odd") / "data", {"train": make_split(NUM_TRAIN, rng),
                                                                        "test": make_split(16, rng)})


# ---------------------------------------------------------------- the stream

def _epochs_seen(num_examples, *, global_batch, replicas, shares, first_image=0, epochs=EPOCHS):
    """Per epoch, the steps of each input pipeline as (labels, weights); the images are their own indices."""
    images = tf.constant(np.arange(num_examples, dtype=np.uint8).reshape(-1, 1, 1, 1))
    labels = tf.range(num_examples, dtype=tf.int64)
    steps = input_engine.steps_per_epoch(num_examples - first_image, global_batch)
    stream = input_engine.Stream(num_examples=num_examples, global_batch=global_batch, buffer_size=8, seed=3,
                                 epochs=epochs, first_image=first_image)
    split = cached_split(images, labels)
    streams = [iter(input_engine.train_batches(split, stream, pad_to=replicas if replicas > 1 else None,
                                               share=(index, shares)))
               for index in range(shares)]
    seen = []
    for epoch in range(epochs):
        count = steps if epoch == 0 else input_engine.steps_per_epoch(num_examples, global_batch)
        seen.append([[tuple(t.numpy().tolist() for t in next(stream)[1:]) for stream in streams]
                     for _ in range(count)])
    return seen


@pytest.mark.parametrize("global_batch, replicas, shares, first_image", [
    (8, 2, 2, 0),  # two workers, last batch 1
    (8, 2, 1, 0),  # two replicas in one process (Keras splits the batch), last batch 1
    (16, 2, 1, 16),  # a resize-resume whose rest of the epoch is 1 image, on 2 replicas
    (16, 4, 4, 14),  # the rest is 3 images on 4 workers
    (3, 8, 8, 0),  # every global batch smaller than the replica count
], ids=["workers", "replicas", "resume-rest-1", "resume-rest-3", "tiny-batches"])
def test_every_image_once_an_epoch_and_no_empty_share(global_batch, replicas, shares, first_image):
    epochs = _epochs_seen(NUM_TRAIN, global_batch=global_batch, replicas=replicas, shares=shares,
                          first_image=first_image)
    for number, epoch in enumerate(epochs):
        # The tutorial's seeded shuffle of the epoch.
        order = list(tf.data.Dataset.range(NUM_TRAIN).shuffle(8, seed=3 + number, reshuffle_each_iteration=False)
                     .as_numpy_iterator())
        trained = [label for step in epoch for labels, weights in step for label, weight in zip(labels, weights)
                   if weight == 1]
        # In the epoch's seeded order, from the resumed image on, each image once, with weight 1.
        assert trained == order[first_image if number == 0 else 0:]
        for step in epoch:
            real = sum(sum(weights) for _, weights in step)
            if shares > 1:
                # Each worker's share is non-empty, and the padding (weight 0) only fills shares that had none.
                assert all(len(labels) >= 1 for labels, _ in step)
                assert sum(len(labels) for labels, _ in step) == max(real, replicas)
            else:
                # One pipeline holds the global batch, which Keras splits: at least one example a replica.
                (labels, weights), = step
                assert len(labels) == max(real, replicas) and set(weights[int(real):]) <= {0.0}
            assert set(w for _, weights in step for w in weights) <= {0.0, 1.0}


def test_one_replica_is_neither_padded_nor_weighted():
    (epoch, _) = _epochs_seen(NUM_TRAIN, global_batch=8, replicas=1, shares=1)
    assert [len(labels) for (labels,), in epoch] == [8, 8, 1]


# ---------------------------------------------------------------- the update

# Two replicas on logical CPUs, with oneDNN off so that an empty replica batch trains there: the padded stream
# and the one with an empty share give the same weights after two epochs of SGD.
UPDATE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import data
    from small_data import cached_split
    from machinery import input_engine
    from model import build_model, keras

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras.utils.set_random_seed(1)
    image_shape, num_classes = data.image_shape_and_classes()  # from tfds's DatasetInfo
    rng = np.random.default_rng(0)
    images = tf.constant(rng.integers(0, 256, (17, *image_shape), dtype=np.uint8))
    labels = tf.constant(rng.integers(0, num_classes, 17), tf.int64)
    with strategy.scope():
        initial = build_model(image_shape, num_classes).get_weights()
    out = {"initial": [w.tolist() for w in initial]}
    for replicas in (2, 1):  # 1: not padded, so the last batch of one example leaves the second replica empty
        stream = input_engine.train_batches(
            cached_split(images, labels),
            input_engine.Stream(num_examples=17, global_batch=8, buffer_size=8, seed=3, epochs=2),
            pad_to=replicas if replicas > 1 else None)
        with strategy.scope():
            model = build_model(image_shape, num_classes)
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.5),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(stream, epochs=2, steps_per_epoch=3, verbose=0)
        out[str(replicas)] = [w.tolist() for w in model.get_weights()]
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.slow
def test_padding_leaves_each_update_that_of_the_real_examples(tmp_path):
    out = tmp_path / "weights.json"
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "TF_ENABLE_ONEDNN_OPTS": "0"}
    proc = subprocess.run([sys.executable, "-c", UPDATE_SCRIPT, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = json.loads(out.read_text())
    assert max_abs_diff(weights["initial"], weights["1"]) > 1e-3, "training must move the weights"
    assert max_abs_diff(weights["2"], weights["1"]) < 1e-6


@pytest.mark.slow
def test_tensorflow_still_aborts_on_an_empty_batch_probe(tmp_path):
    """The probe that tells when input_engine.padded can go: docs/upstream/empty_batch_maxpoolgrad.py, run as TensorFlow
    comes (oneDNN on) and with oneDNN off. Off, it must run on any CPU (else the reproducer is broken); on, it
    aborts on some CPUs only, and the test says which it did here."""
    def probe(**env):
        # An aborted probe leaves autograph's file of its traced function in its temp dir: this test's, not /tmp.
        return subprocess.run([sys.executable, REPRODUCER], env={**subprocess_env(), "TMPDIR": str(tmp_path), **env},
                              capture_output=True, text=True, timeout=120)

    off = probe(TF_ENABLE_ONEDNN_OPTS="0")
    assert off.returncode == 0 and "shape (0, 4, 4, 1)" in off.stdout, off.stderr[-3000:]
    on = probe()
    aborted = on.returncode == -signal.SIGABRT
    assert aborted or on.returncode == 0, on.stderr[-3000:]
    if aborted:
        assert "MaxPooling" in on.stderr or "Check failed" in on.stderr, on.stderr[-3000:]
    warnings.warn(f"TensorFlow {tf.__version__} {'still aborts' if aborted else 'no longer aborts'} on an empty "
                  f"batch's MaxPoolGrad on this CPU ({_cpu_model()}): "
                  f"{'keep' if aborted else 'if no CPU aborts, remove'} input_engine.padded")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


# ---------------------------------------------------------------- whole runs

def _args(odd_data_dir, output_dir, *extra):
    return ["--epochs", str(EPOCHS), "--steps-per-execution", "1", "--data-dir", odd_data_dir,
            "--output-dir", str(output_dir), *extra]


@pytest.mark.slow
def test_a_resize_resume_with_one_image_left_and_two_replicas_finishes(tmp_path, odd_data_dir):
    """One replica at batch 16 is pre-empted after its first step (image 16 of 17); two replicas at 8 each
    resume with one image left of the epoch, then train a whole epoch, whose last batch is one example too."""
    out = tmp_path / "out"
    first = Worker(_args(odd_data_dir, out, "--batch-size-per-replica", "16", "--backup-every-steps", "1"), {},
                   tmp_path, "one")
    # Keras prints the epoch's header once the backup callback has begun training: SIGTERM is then acted on at
    # the first step's end (the step's tracing takes over a second).
    first.wait_for("Epoch 1/")
    first.proc.send_signal(signal.SIGTERM)
    assert finish([first], timeout=120) == [EXIT_PREEMPTED], first.stderr[-3000:]
    assert images_at(first.stderr, "pre-empted (SIGTERM)") == [16], first.stderr[-3000:]

    second = Worker(_args(odd_data_dir, out, "--batch-size-per-replica", "8", "--cpu-replicas", "2"), {},
                    tmp_path, "two")
    assert finish([second], timeout=300) == [EXIT_OK], second.stderr[-3000:]
    assert "Number of devices: 2" in second.stdout
    assert images_at(second.stdout, "Resuming from") == [16]
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * NUM_TRAIN
    assert results["resumed_after_images"] == 16


@pytest.mark.slow
def test_two_workers_with_a_last_batch_of_one_finish(tmp_path, odd_data_dir):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    workers = [Worker(_args(odd_data_dir, tmp_path / "out", "--batch-size-per-replica", "8", "--strategy",
                            "multiworker"),
                      {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})},
                      tmp_path, f"w{index}")
               for index in range(2)]
    statuses = finish(workers, timeout=300)
    assert statuses == [EXIT_OK, EXIT_OK], [w.stderr[-3000:] for w in workers]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["replicas"] == 2 and results["train_images"] == EPOCHS * NUM_TRAIN
