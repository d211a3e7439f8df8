"""Step 2's input path: the resident splits are tfds's examples in tfds's order, the batches gathered from them by
shuffled indices are the batches of the tutorial's per-example shuffle with the same seed, and a streamed split
gives the same batches as a resident one."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import data
import train_mnist_mirrored
from config import Config
from conftest import NUM_TEST, NUM_TRAIN, ROOT, max_abs_diff, smoke_args, subprocess_env
from machinery import input_engine
from machinery.input_engine import Stream, steps_per_epoch

BUFFER = 100  # smaller than the split, so the shuffle's buffer matters as it does on MNIST (10,000 of 60,000)
BATCH = 24  # NUM_TRAIN is not a multiple of it: every epoch ends with a short batch
SEED = 5


@pytest.fixture(scope="module")
def loaded(data_dir):
    info = data.load(Config.dataset, data_dir)
    datasets = tfds.load(Config.dataset, data_dir=data_dir, as_supervised=True)
    return datasets, info, {split: data.split(info, split, limit_mb=Config.resident_limit_mb)
                            for split in ("train", "test")}


def streamed(info, split):
    return input_engine.Split(info, split)


@pytest.mark.parametrize("split, count", [("train", NUM_TRAIN), ("test", NUM_TEST)])
def test_resident_split_is_tfds_load_in_the_same_order(loaded, split, count):
    datasets, info, splits = loaded
    assert splits[split].how == input_engine.RESIDENT
    images, labels = splits[split].images, splits[split].labels
    assert images.dtype == tf.uint8 and tuple(images.shape) == (count, *info.features["image"].shape)
    assert labels.dtype == tf.int64 and tuple(labels.shape) == (count,)
    expected = list(tfds.as_numpy(datasets[split]))
    np.testing.assert_array_equal(images.numpy(), np.stack([image for image, _ in expected]))
    np.testing.assert_array_equal(labels.numpy(), np.array([label for _, label in expected]))


def _tutorial_epoch(datasets, epoch, steps):
    """One epoch as the tutorial's per-example pipeline gives it, seeded as the project seeds each epoch."""
    examples = datasets["train"].map(data.scale).shuffle(BUFFER, seed=SEED + epoch, reshuffle_each_iteration=False)
    return list(tfds.as_numpy(examples.batch(BATCH).take(steps)))


@pytest.mark.parametrize("first_epoch, first_step", [(0, 0), (2, 0), (1, 5)], ids=["fresh", "epoch", "mid-epoch"])
def test_gathered_batches_equal_the_per_example_shuffle(loaded, first_epoch, first_step):
    datasets, _, splits = loaded
    epochs, steps = 4, steps_per_epoch(NUM_TRAIN, BATCH)
    stream = input_engine.step_batches(splits["train"], Stream(
        num_examples=NUM_TRAIN, global_batch=BATCH, buffer_size=BUFFER, seed=SEED, epochs=epochs,
        first_epoch=first_epoch, first_image=first_step * BATCH), data.RECIPE)
    got = list(tfds.as_numpy(stream.take((epochs - first_epoch) * steps - first_step)))
    # A resumed stream is the uninterrupted one from its resume step on.
    expected = [batch for epoch in range(first_epoch, epochs) for batch in _tutorial_epoch(datasets, epoch, steps)]
    expected = expected[first_step:]
    assert len(got) == len(expected)
    assert len(got[steps - 1 - first_step][1]) == NUM_TRAIN % BATCH  # an epoch's short last batch is kept
    for (got_images, got_labels), (images, labels) in zip(got, expected):
        assert got_images.dtype == np.float32 and got_images.max() <= 1.0
        np.testing.assert_array_equal(got_labels, labels)
        np.testing.assert_array_equal(got_images, images)
    # Epochs differ from each other: each is shuffled with its own seed.
    assert not np.array_equal(got[0][1], got[steps - first_step][1])


def test_seed_zero_gives_the_per_example_shuffle_of_seed_zero(loaded):
    """`--seed 0` sets TensorFlow's global seed to 0, with which a shuffle seeded by a tensor failed to trace."""
    steps = steps_per_epoch(NUM_TRAIN, BATCH)
    tf.random.set_seed(0)
    try:
        got = list(tfds.as_numpy(input_engine.index_batches(Stream(num_examples=NUM_TRAIN, global_batch=BATCH,
                                                                   buffer_size=BUFFER, seed=0, epochs=2), data.RECIPE)))
        expected = [batch for epoch in range(2) for batch in tfds.as_numpy(
            tf.data.Dataset.range(NUM_TRAIN).shuffle(BUFFER, seed=epoch, reshuffle_each_iteration=False).batch(BATCH))]
    finally:
        tf.random.set_seed(None)
    assert len(got) == len(expected) == 2 * steps
    for got_batch, batch in zip(got, expected):
        np.testing.assert_array_equal(got_batch, batch)


def test_one_replica_gets_the_same_batches_without_the_multi_device_iterator(loaded):
    _, _, splits = loaded
    steps = steps_per_epoch(NUM_TRAIN, BATCH)

    def stream(share=input_engine.WHOLE):
        return input_engine.step_batches(splits["train"], Stream(num_examples=NUM_TRAIN, global_batch=BATCH,
                                                                 buffer_size=BUFFER, seed=SEED, epochs=2),
                                         data.RECIPE, share=share)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    distributed = input_engine.distribute(strategy, stream)
    assert isinstance(distributed, tf.distribute.DistributedDataset)
    iterator = iter(distributed)
    # The strategy's per-replica input reads the dataset itself: no multi-device iterator (whose device-side
    # autotuner stalled the end of `fit`) stands between them.
    assert "MultiDevice" not in type(iterator._iterators[0]._iterator).__name__
    expected = list(tfds.as_numpy(stream().take(2 * steps)))
    for images, labels in expected:
        got_images, got_labels = next(iterator)
        np.testing.assert_array_equal(got_images.numpy(), images)
        np.testing.assert_array_equal(got_labels.numpy(), labels)


def test_multi_device_iterators_build_their_device_pipelines_untuned(loaded):
    """Several replicas or workers, and their evaluations, still read through TensorFlow's multi-device iterator;
    once the run has distributed its input, the device-side pipelines that iterator builds have tf.data's
    autotuner off (its thread, waited for at teardown, held a two-worker `fit` long after its last epoch:
    docs/history.md, "What changed in the project")."""
    _, _, splits = loaded
    test = input_engine.eval_batches(splits["test"], data.RECIPE, global_batch=BATCH)
    input_engine.distribute(tf.distribute.MirroredStrategy(["/cpu:0"]), lambda share: test)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    iterator = iter(strategy.experimental_distribute_dataset(test))  # what Keras's evaluate builds
    multi_device = iterator._iterators[0]._iterator
    assert "MultiDevice" in type(multi_device).__name__
    device_pipelines = [device_iterator._dataset for device_iterator in multi_device._device_iterators]
    assert device_pipelines and all(ds.options().autotune.enabled is False for ds in device_pipelines)
    # The same batches come through.
    got_images, got_labels = next(iterator)
    images, labels = next(iter(test))
    np.testing.assert_array_equal(got_images.numpy(), images.numpy())
    np.testing.assert_array_equal(got_labels.numpy(), labels.numpy())


@pytest.mark.parametrize("how", [input_engine.RESIDENT, input_engine.STREAMED])
def test_eval_batches_are_the_test_split_in_order(loaded, how):
    datasets, info, splits = loaded
    test = splits["test"] if how == input_engine.RESIDENT else streamed(info, "test")
    got = list(tfds.as_numpy(input_engine.eval_batches(test, data.RECIPE, global_batch=BATCH)))
    expected = list(tfds.as_numpy(datasets["test"].map(data.scale).batch(BATCH)))
    assert len(got) == len(expected)
    for (got_images, got_labels), (images, labels) in zip(got, expected):
        np.testing.assert_array_equal(got_images, images)
        np.testing.assert_array_equal(got_labels, labels)


def test_one_replica_evaluates_without_the_multi_device_iterator(loaded):
    """Every evaluation of a single replica reads the test split through the strategy's per-replica input, as its
    training does, and gives Keras's own path's loss and accuracy."""
    from model import build_model, compile_model

    _, info, splits = loaded
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    test = data.eval_input(strategy, splits["test"], global_batch=BATCH)
    assert isinstance(test.dataset, tf.distribute.DistributedDataset)
    assert test.steps == steps_per_epoch(NUM_TEST, BATCH)
    assert "MultiDevice" not in type(iter(test.dataset)._iterators[0]._iterator).__name__
    with strategy.scope():
        model, twin = (compile_model(build_model(*data.image_shape_and_classes(info)), steps_per_execution=2)
                       for _ in range(2))
    twin.set_weights(model.get_weights())  # a test function is traced for one kind of iterator
    fast = model.evaluate(test.dataset, steps=test.steps, verbose=0)
    keras_path = twin.evaluate(input_engine.eval_batches(splits["test"], data.RECIPE, global_batch=BATCH), verbose=0)
    np.testing.assert_allclose(fast, keras_path, rtol=1e-6)
    # Anywhere else (here TensorFlow's default strategy) Keras's own path reads the batches, to their end.
    plain = data.eval_input(tf.distribute.get_strategy(), splits["test"], global_batch=BATCH)
    assert isinstance(plain.dataset, tf.data.Dataset) and plain.steps is None


# ---------------------------------------------------------------- a split larger than the memory limit

def test_a_split_over_the_limit_streams_and_one_within_it_stays_resident(loaded):
    _, info, _ = loaded
    mb = input_engine.split_mb(info, "train")
    image_shape, _ = data.image_shape_and_classes(info)
    assert mb == pytest.approx(NUM_TRAIN * np.prod(image_shape) / 2**20)  # uint8: a byte a pixel
    assert data.split(info, "train", limit_mb=mb).how == input_engine.RESIDENT
    over = data.split(info, "train", limit_mb=mb / 2)
    assert over.how == input_engine.STREAMED and over.images is None and over.num_examples == NUM_TRAIN


@pytest.mark.parametrize("first_epoch, first_image, replicas, epoch_images",
                         [(0, 0, 1, None), (1, 5 * BATCH + 7, 1, None), (0, 0, 2, BATCH + 1)],
                         ids=["fresh", "resumed-mid-epoch", "two-workers-padded"])
def test_a_streamed_split_gives_the_resident_batches(loaded, first_epoch, first_image, replicas, epoch_images):
    """The same images in the same order, scaled alike, whether held in memory or streamed: a run resumed at any
    image trains the same batches either way. Two workers' shares of epochs whose last batch holds one image, so
    that it is padded, and their weights, too."""
    _, info, splits = loaded
    stream = Stream(num_examples=NUM_TRAIN, global_batch=BATCH, buffer_size=BUFFER, seed=SEED, epochs=3,
                    first_epoch=first_epoch, first_image=first_image, epoch_images=epoch_images)
    pad_to = replicas if replicas > 1 else None
    count = (3 - first_epoch) * steps_per_epoch(stream.images_an_epoch, BATCH) - first_image // BATCH
    for share in ([(i, replicas) for i in range(replicas)] if replicas > 1 else [input_engine.WHOLE]):
        resident, stream_of = (list(tfds.as_numpy(input_engine.step_batches(split, stream, data.RECIPE, pad_to=pad_to,
                                                                            share=share).take(count)))
                               for split in (splits["train"], streamed(info, "train")))
        assert len(resident) == len(stream_of) == count
        if pad_to:
            assert resident[1][2].tolist() == [share == (0, 2)]  # the one image, or its padding at weight 0
        for got, expected in zip(stream_of, resident):
            assert len(got) == len(expected) == (3 if pad_to else 2)
            np.testing.assert_array_equal(got[2:], expected[2:])  # the weights, where padded
            real = got[2] == 1 if pad_to else slice(None)  # a padding example's image and label weigh 0
            for part, expected_part in zip(got[:2], expected[:2]):
                np.testing.assert_array_equal(part[real], expected_part[real])


def test_a_corrupt_record_file_is_a_clean_error(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    broken = tmp_path / "tfds"
    shutil.copytree(data_dir, broken)
    (record,) = [os.path.join(d, f) for d, _, files in os.walk(broken) for f in files if "train.tfrecord" in f]
    with open(record, "r+b") as f:
        f.truncate(os.path.getsize(record) // 2)  # a copy cut short, as by a full disk
    rc = train_mnist_mirrored.main(smoke_args(str(broken), str(tmp_path / "out")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error:") and "cannot be read" in err[0] and "prepare" in err[0], err
    assert not (tmp_path / "out").exists()


# The run's own path: only indices through tf.data, each step gathering its batch from the resident split. On one
# replica and on two (whose batches carry the padding weights), a model trained so ends with the weights of the
# same model trained on the gathered batches themselves.
IN_STEP_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import data
    from model import build_model, keras

    image_shape, num_classes = data.image_shape_and_classes()  # from tfds's DatasetInfo
    rng = np.random.default_rng(0)
    images = tf.constant(rng.integers(0, 256, (17, *image_shape), dtype=np.uint8))
    labels = tf.constant(rng.integers(0, num_classes, 17), tf.int64)
    from machinery import input_engine
    stream = input_engine.Stream(num_examples=17, global_batch=8, buffer_size=8, seed=3, epochs=2)
    split = input_engine.Split(None, "train", images, labels)
    out = {}
    for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
        strategy = tf.distribute.MirroredStrategy(devices)
        replicas = len(devices)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            initial = build_model(image_shape, num_classes).get_weights()
        for path in ("batches", "in_step"):
            with strategy.scope():
                model = build_model(image_shape, num_classes)
                model.set_weights(initial)
                model.compile(optimizer=keras.optimizers.SGD(0.5),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if path == "batches":
                train = input_engine.step_batches(split, stream, data.RECIPE, pad_to=replicas if replicas > 1 else None)
            else:
                train = data.training_input(strategy, model, split, stream)
                # One copy of the split on each replica's device, as the weights have.
                resident = input_engine.resident_copies(strategy, images, labels)
                out[f"devices_{replicas}"] = sorted(copy.device for copy in strategy.experimental_local_results(resident[0]))
            model.fit(train, epochs=2, steps_per_epoch=3, verbose=0)
            out[f"{path}_{replicas}"] = [w.tolist() for w in model.get_weights()]
        out[f"initial_{replicas}"] = [w.tolist() for w in initial]
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.slow
def test_gathering_in_the_step_trains_as_the_gathered_batches(tmp_path):
    out = tmp_path / "weights.json"
    env = {**subprocess_env(), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", IN_STEP_SCRIPT, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = json.loads(out.read_text())
    for replicas in (1, 2):
        assert max_abs_diff(weights[f"initial_{replicas}"], weights[f"in_step_{replicas}"]) > 1e-3
        assert max_abs_diff(weights[f"batches_{replicas}"], weights[f"in_step_{replicas}"]) < 1e-6, replicas
        assert [device.rsplit(":", 2)[-2:] for device in weights[f"devices_{replicas}"]] == \
            [["CPU", str(i)] for i in range(replicas)]
