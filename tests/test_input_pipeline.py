"""Step 2's input path: a cached split holds data.scale of tfds's examples in tfds's order, the batches gathered
from it by shuffled indices are the batches of the tutorial's per-example pipeline with the same seed, a streamed
split gives the same batches as a cached one (augmented ones too, at any resume), the test split is never
augmented, and images that vary in size are refused unless data.scale resizes them."""

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
from processes import ROOT, assert_refused_in_one_line, subprocess_env
from runs import max_abs_diff, smoke_args
from small_data import NUM_TEST, NUM_TRAIN
from machinery import input_engine, tfds_builders
from machinery.exits import UsageError
from machinery.input_engine import Stream, steps_per_epoch

BUFFER = 100  # smaller than the split, so the shuffle's buffer matters as it does on MNIST (10,000 of 60,000)
BATCH = 24  # NUM_TRAIN is not a multiple of it: every epoch ends with a short batch
SEED = 5
TESTS = os.path.join(ROOT, "tests")  # on the scripts' path, for small_data.cached_split


@pytest.fixture(scope="module")
def loaded(data_dir):
    info = data.load(Config.dataset, data_dir)
    datasets = tfds.load(Config.dataset, data_dir=data_dir, as_supervised=True)
    return datasets, info, {split: data.split(info, split, limit_mb=Config.resident_limit_mb)
                            for split in ("train", "test")}


def streamed(info, split):
    """The split as a run over --resident-limit-mb reads it: streamed from tfds's files."""
    opened = input_engine.open_split(info, split, data.scale, limit_mb=0)
    assert opened.how == input_engine.STREAMED
    return opened


def stream_of(first_epoch=0, first_image=0, epochs=3, **kwargs):
    return Stream(num_examples=NUM_TRAIN, global_batch=BATCH, buffer_size=BUFFER, seed=SEED, epochs=epochs,
                  first_epoch=first_epoch, first_image=first_image, **kwargs)


def batches_of(dataset, count):
    return list(tfds.as_numpy(dataset.take(count)))


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for got_batch, batch in zip(got, expected):
        assert len(got_batch) == len(batch)
        for got_part, part in zip(got_batch, batch):
            assert got_part.dtype == part.dtype
            np.testing.assert_array_equal(got_part, part)


@pytest.mark.parametrize("split, count", [("train", NUM_TRAIN), ("test", NUM_TEST)])
def test_the_cache_is_tfds_examples_scaled_in_tfds_order(loaded, split, count):
    """What the tutorial's `map(scale).cache()` holds: each of tfds's examples through data.scale (float32 images
    in [0, 1]), in tfds's order, in variables on the host's CPU."""
    datasets, info, splits = loaded
    opened = splits[split]
    assert opened.how == input_engine.RESIDENT and opened.num_examples == count
    features, labels = opened.cache
    image_shape = info.features["image"].shape
    assert features.dtype == tf.float32 and tuple(features.shape) == (count, *image_shape)
    assert labels.dtype == tf.int64 and tuple(labels.shape) == (count,)
    assert opened.element_spec == (tf.TensorSpec(image_shape, tf.float32), tf.TensorSpec((), tf.int64))
    assert all(variable.device.endswith("CPU:0") for variable in opened.cache)
    expected = list(tfds.as_numpy(datasets[split].map(data.scale)))
    np.testing.assert_array_equal(features.numpy(), np.stack([image for image, _ in expected]))
    np.testing.assert_array_equal(labels.numpy(), np.array([label for _, label in expected]))
    assert 0.0 <= features.numpy().min() and features.numpy().max() <= 1.0


def _tutorial_epoch(datasets, epoch, steps):
    """One epoch as the tutorial's per-example pipeline gives it, seeded as the project seeds each epoch."""
    examples = datasets["train"].map(data.scale).shuffle(BUFFER, seed=SEED + epoch, reshuffle_each_iteration=False)
    return list(tfds.as_numpy(examples.batch(BATCH).take(steps)))


@pytest.mark.parametrize("first_epoch, first_step", [(0, 0), (2, 0), (1, 5)], ids=["fresh", "epoch", "mid-epoch"])
def test_gathered_batches_equal_the_per_example_shuffle(loaded, first_epoch, first_step):
    datasets, _, splits = loaded
    epochs, steps = 4, steps_per_epoch(NUM_TRAIN, BATCH)
    stream = input_engine.train_batches(splits["train"], stream_of(first_epoch, first_step * BATCH, epochs))
    got = batches_of(stream, (epochs - first_epoch) * steps - first_step)
    # A resumed stream is the uninterrupted one from its resume step on.
    expected = [batch for epoch in range(first_epoch, epochs) for batch in _tutorial_epoch(datasets, epoch, steps)]
    expected = expected[first_step:]
    assert len(got) == len(expected)
    assert len(got[steps - 1 - first_step][1]) == NUM_TRAIN % BATCH  # an epoch's short last batch is kept
    for got_batch, (images, labels) in zip(got, expected):
        got_images, got_labels = got_batch
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
                                                                   buffer_size=BUFFER, seed=0, epochs=2))))
        expected = [batch for epoch in range(2) for batch in tfds.as_numpy(
            tf.data.Dataset.range(NUM_TRAIN).shuffle(BUFFER, seed=epoch, reshuffle_each_iteration=False).batch(BATCH))]
    finally:
        tf.random.set_seed(None)
    assert len(got) == len(expected) == 2 * steps
    for step, ((got_batch, epoch), batch) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(got_batch, batch)
        assert epoch == step // steps  # each batch of indices carries its epoch, for the augmentation's seeds


def test_one_replica_gets_the_same_batches_without_the_multi_device_iterator(loaded):
    _, _, splits = loaded
    steps = steps_per_epoch(NUM_TRAIN, BATCH)

    def stream(share=input_engine.WHOLE):
        return input_engine.train_batches(splits["train"], stream_of(epochs=2), share=share)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    distributed = input_engine.distribute(strategy, stream)
    assert isinstance(distributed, tf.distribute.DistributedDataset)
    iterator = iter(distributed)
    # The strategy's per-replica input reads the dataset itself: no multi-device iterator (whose device-side
    # autotuner stalled the end of `fit`) stands between them.
    assert "MultiDevice" not in type(iterator._iterators[0]._iterator).__name__
    expected = batches_of(stream(), 2 * steps)
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
    test = input_engine.eval_batches(splits["test"], global_batch=BATCH)
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
    got = list(tfds.as_numpy(input_engine.eval_batches(test, global_batch=BATCH)))
    expected = list(tfds.as_numpy(datasets["test"].map(data.scale).batch(BATCH)))
    assert_same_batches(got, expected)


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
        model, twin = (compile_model(build_model(*data.model_input(splits["train"], info)), steps_per_execution=2)
                       for _ in range(2))
    twin.set_weights(model.get_weights())  # a test function is traced for one kind of iterator
    fast = model.evaluate(test.dataset, steps=test.steps, verbose=0)
    keras_path = twin.evaluate(input_engine.eval_batches(splits["test"], global_batch=BATCH), verbose=0)
    np.testing.assert_allclose(fast, keras_path, rtol=1e-6)
    # Anywhere else (here TensorFlow's default strategy) Keras's own path reads the batches, to their end.
    plain = data.eval_input(tf.distribute.get_strategy(), splits["test"], global_batch=BATCH)
    assert isinstance(plain.dataset, tf.data.Dataset) and plain.steps is None


# ---------------------------------------------------------------- a split larger than the memory limit

def test_a_split_over_the_limit_streams_and_one_within_it_stays_resident(loaded):
    _, info, splits = loaded
    mb = input_engine.cache_mb(splits["train"].element_spec, NUM_TRAIN)
    image_shape, _ = data.image_shape_and_classes(info)
    # Scaled: a float32 image (4 bytes a pixel) and an int64 label an example.
    assert mb == pytest.approx(NUM_TRAIN * (4 * np.prod(image_shape) + 8) / 2**20)
    assert data.split(info, "train", limit_mb=mb).how == input_engine.RESIDENT
    over = data.split(info, "train", limit_mb=mb / 2)
    assert over.how == input_engine.STREAMED and over.cache is None and over.num_examples == NUM_TRAIN
    assert over.element_spec == splits["train"].element_spec  # what the model is built for, either way


@pytest.mark.parametrize("first_epoch, first_image, replicas, epoch_images",
                         [(0, 0, 1, None), (1, 5 * BATCH + 7, 1, None), (0, 0, 2, BATCH + 1)],
                         ids=["fresh", "resumed-mid-epoch", "two-workers-padded"])
def test_a_streamed_split_gives_the_resident_batches(loaded, first_epoch, first_image, replicas, epoch_images):
    """The same images in the same order, scaled alike, whether held in memory or streamed: a run resumed at any
    image trains the same batches either way. Two workers' shares of epochs whose last batch holds one image, so
    that it is padded, and their weights, too."""
    _, info, splits = loaded
    stream = stream_of(first_epoch, first_image, epoch_images=epoch_images)
    pad_to = replicas if replicas > 1 else None
    count = (3 - first_epoch) * steps_per_epoch(stream.images_an_epoch, BATCH) - first_image // BATCH
    for share in ([(i, replicas) for i in range(replicas)] if replicas > 1 else [input_engine.WHOLE]):
        resident, stream_read = (batches_of(input_engine.train_batches(split, stream, pad_to=pad_to, share=share),
                                            count)
                                 for split in (splits["train"], streamed(info, "train")))
        assert len(resident) == len(stream_read) == count
        if pad_to:
            assert resident[1][2].tolist() == [share == (0, 2)]  # the one image, or its padding at weight 0
        for got, expected in zip(stream_read, resident):
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


# ---------------------------------------------------------------- an augmentation: data.augment

PAD = 4  # pixels added each side before the crop: 9 x 9 crops of each image


def crop(image, label, seed):
    """An `augment(image, label, seed)` as a user would write data.augment: a random crop of the image, padded
    with PAD pixels of black each side, back to its size, drawn from the example's own seed."""
    height, width, channels = image.shape
    padded = tf.image.resize_with_crop_or_pad(image, height + 2 * PAD, width + 2 * PAD)
    return tf.image.stateless_random_crop(padded, (height, width, channels), seed), label


def examples_of(batches):
    """A stream's examples in order, out of its batches: all images, and all labels."""
    return np.concatenate([images for images, _ in batches]), np.concatenate([labels for _, labels in batches])


@pytest.mark.parametrize("first_epoch, first_image", [(1, 5 * BATCH), (1, 5 * BATCH + 7), (2, 0)],
                         ids=["resumed-at-a-batch", "resumed-mid-batch", "resumed-at-an-epoch"])
def test_an_augmented_stream_is_one_on_either_path_and_at_any_resume(loaded, first_epoch, first_image):
    """data.augment draws from each example's own seed: the cached and the streamed split augment alike, and a run
    resumed at any image trains exactly the augmented examples an uninterrupted run trains from there on."""
    _, info, splits = loaded
    steps = steps_per_epoch(NUM_TRAIN, BATCH)
    whole = batches_of(input_engine.train_batches(splits["train"], stream_of(), augment=crop), 3 * steps)
    streamed_whole = batches_of(input_engine.train_batches(streamed(info, "train"), stream_of(), augment=crop),
                                3 * steps)
    assert_same_batches(streamed_whole, whole)
    # Augmented: not the scaled examples themselves.
    plain = batches_of(input_engine.train_batches(splits["train"], stream_of()), 3 * steps)
    np.testing.assert_array_equal(examples_of(whole)[1], examples_of(plain)[1])  # the labels, untouched
    assert not np.array_equal(examples_of(whole)[0], examples_of(plain)[0])

    resumed_count = (3 - first_epoch) * steps - first_image // BATCH
    position = first_epoch * NUM_TRAIN + first_image
    for split in (splits["train"], streamed(info, "train")):
        resumed = batches_of(input_engine.train_batches(split, stream_of(first_epoch, first_image), augment=crop),
                             resumed_count)
        # Batched from the resumed image: whole batches, each epoch's last one short.
        sizes = [len(labels) for _, labels in resumed]
        first_epoch_steps = steps_per_epoch(NUM_TRAIN - first_image, BATCH)
        assert sum(sizes) == 3 * NUM_TRAIN - position and len(sizes) == resumed_count
        assert sizes[first_epoch_steps - 1] == ((NUM_TRAIN - first_image) % BATCH or BATCH)
        for got, expected in zip(examples_of(resumed), examples_of(whole)):
            np.testing.assert_array_equal(got, expected[position:])
        if first_image % BATCH == 0:  # resumed on a batch boundary: the very batches of the uninterrupted run
            assert_same_batches(resumed, whole[first_epoch * steps + first_image // BATCH:])


def test_each_epoch_augments_an_example_anew(loaded):
    """The same example in two epochs is cropped differently (each epoch draws its own seeds), and each augmented
    image is the one crop its seed gives of that example."""
    _, _, splits = loaded
    steps = steps_per_epoch(NUM_TRAIN, BATCH)
    stream = stream_of(epochs=2)
    batches = batches_of(input_engine.train_batches(splits["train"], stream, augment=crop), 2 * steps)
    indices = list(tfds.as_numpy(input_engine.index_batches(stream)))
    images, labels = splits["train"].cache
    by_epoch = [{}, {}]
    for (batch_images, batch_labels), (batch_indices, epoch) in zip(batches, indices):
        for image, label, index in zip(batch_images, batch_labels, batch_indices):
            assert label == labels[index].numpy()
            by_epoch[epoch][int(index)] = image
    assert sorted(by_epoch[0]) == sorted(by_epoch[1]) == list(range(NUM_TRAIN))  # every example once an epoch
    differ = sum(not np.array_equal(by_epoch[0][index], by_epoch[1][index]) for index in range(NUM_TRAIN))
    # 81 crops an image: two epochs' draws coincide for about one example in 81.
    assert differ >= 0.9 * NUM_TRAIN, differ
    for epoch in (0, 1):
        for index in (0, 7, NUM_TRAIN - 1):
            seed = input_engine.example_seeds(stream, epoch, tf.constant([index]))[0]
            expected, _ = crop(images[index], labels[index], seed)
            np.testing.assert_array_equal(by_epoch[epoch][index], expected.numpy())


def test_data_augment_augments_the_training_stream_and_never_the_test_split(loaded, monkeypatch):
    """data.py's `augment` reaches the training stream (data.training_input) and nothing else: each evaluation reads
    the test split scaled only, cached or streamed."""
    datasets, info, splits = loaded
    monkeypatch.setattr(data, "augment", crop)
    strategy = tf.distribute.get_strategy()  # one replica, no distribution: the plain datasets
    steps = steps_per_epoch(NUM_TRAIN, BATCH)
    trained = batches_of(data.training_input(strategy, splits["train"], stream_of(epochs=1)), steps)
    assert_same_batches(trained, batches_of(input_engine.train_batches(splits["train"], stream_of(epochs=1),
                                                                       augment=crop), steps))
    plain = batches_of(input_engine.train_batches(splits["train"], stream_of(epochs=1)), steps)
    assert not np.array_equal(examples_of(trained)[0], examples_of(plain)[0])
    expected = list(tfds.as_numpy(datasets["test"].map(data.scale).batch(BATCH)))
    for test in (splits["test"], streamed(info, "test")):
        evaluation = data.eval_input(strategy, test, global_batch=BATCH)
        assert_same_batches(list(tfds.as_numpy(evaluation.dataset)), expected)


# ---------------------------------------------------------------- images that vary in size

VARYING = "varying_size_blocks"  # no tfds dataset: read from the folder it is prepared in
RESIZED = (8, 8)


def scale_resized(image, label):
    """A data.scale for images of varying size: the tutorial's scale, then every image resized to RESIZED."""
    image, label = data.scale(image, label)
    return tf.image.resize(image, RESIZED), label


@pytest.fixture(scope="module")
def varying_data_dir(tmp_path_factory):
    """A tiny dataset whose images vary in size (6 to 13 pixels a side, 3 channels), 3 classes: tfds stores their
    shape as (None, None, 3)."""
    rng = np.random.default_rng(7)

    def split(n):
        images = [rng.integers(0, 256, (*rng.integers(6, 14, 2), 3), dtype=np.uint8) for _ in range(n)]
        return images, rng.integers(0, 3, n)

    data_dir = tmp_path_factory.mktemp("tfds_varying") / "data"
    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(None, None, 3)),
                                           "label": tfds.features.ClassLabel(num_classes=3)})
    tfds_builders.write_prepared(VARYING, {"train": split(30), "test": split(10)}, str(data_dir), features=features)
    return str(data_dir)


@pytest.mark.parametrize("limit_mb", [1000, 0], ids=["within-the-limit", "streamed"])
def test_images_that_vary_in_size_are_refused_in_one_line_naming_data_scale(varying_data_dir, limit_mb):
    info = data.load(VARYING, varying_data_dir)
    assert data.image_shape_and_classes(info) == ((None, None, 3), 3)
    with pytest.raises(UsageError) as refused:
        data.split(info, "train", limit_mb=limit_mb)
    message = str(refused.value)
    assert "\n" not in message and "vary in size" in message and "data.scale" in message, message


def test_a_run_on_images_that_vary_in_size_is_refused_before_it_writes(varying_data_dir, tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    output_dir = tmp_path / "out"
    rc = train_mnist_mirrored.main(["--dataset", VARYING, *smoke_args(varying_data_dir, str(output_dir))])
    assert_refused_in_one_line(rc, capsys.readouterr().err, ["vary in size", "data.scale"], output_dir)


def test_a_scale_that_resizes_makes_them_one_size_cached_or_streamed(varying_data_dir):
    info = data.load(VARYING, varying_data_dir)
    spec = (tf.TensorSpec((*RESIZED, 3), tf.float32), tf.TensorSpec((), tf.int64))
    cached, streamed_split = (input_engine.open_split(info, "train", scale_resized, limit_mb=limit)
                              for limit in (1000, 0))
    assert (cached.how, streamed_split.how) == (input_engine.RESIDENT, input_engine.STREAMED)
    assert cached.element_spec == streamed_split.element_spec == spec
    features, labels = cached.cache
    assert tuple(features.shape) == (30, *RESIZED, 3) and tuple(labels.shape) == (30,)
    # The cache is tfds's own examples through the resizing scale, in tfds's order.
    expected = list(tfds.as_numpy(tfds.builder_from_directory(info.data_dir).as_dataset(
        "train", as_supervised=True, shuffle_files=False).map(scale_resized)))
    np.testing.assert_array_equal(features.numpy(), np.stack([image for image, _ in expected]))
    np.testing.assert_array_equal(labels.numpy(), np.array([label for _, label in expected]))
    # Both paths give the same batches, for training (a short last batch each epoch) and evaluation.
    stream = Stream(num_examples=30, global_batch=8, buffer_size=16, seed=SEED, epochs=2, first_image=3)
    count = 2 * steps_per_epoch(30, 8)
    assert_same_batches(batches_of(input_engine.train_batches(streamed_split, stream), count),
                        batches_of(input_engine.train_batches(cached, stream), count))
    assert_same_batches(list(tfds.as_numpy(input_engine.eval_batches(streamed_split, global_batch=8))),
                        list(tfds.as_numpy(input_engine.eval_batches(cached, global_batch=8))))


# ---------------------------------------------------------------- what `fit` reads

# The run's own input: `data.training_input` on one replica (the strategy's per-replica input) and on two (Keras
# splits each padded global batch, whose examples carry their weights). A model trained on it ends with the
# weights of the same model trained on `train_batches` itself.
TRAINING_INPUT_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import data
    from small_data import cached_split
    from machinery import input_engine
    from model import build_model, keras

    image_shape, num_classes = data.image_shape_and_classes()  # from tfds's DatasetInfo
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (17, *image_shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, 17).astype(np.int64)
    split = cached_split(images, labels)
    stream = input_engine.Stream(num_examples=17, global_batch=8, buffer_size=8, seed=3, epochs=2)
    out = {}
    for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
        strategy = tf.distribute.MirroredStrategy(devices)
        replicas = len(devices)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            initial = build_model(image_shape, num_classes).get_weights()
        for path in ("batches", "training_input"):
            with strategy.scope():
                model = build_model(image_shape, num_classes)
                model.set_weights(initial)
                model.compile(optimizer=keras.optimizers.SGD(0.5),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if path == "batches":
                train = input_engine.train_batches(split, stream, pad_to=replicas if replicas > 1 else None)
            else:
                train = data.training_input(strategy, split, stream)
            model.fit(train, epochs=2, steps_per_epoch=3, verbose=0)
            out[f"{path}_{replicas}"] = [w.tolist() for w in model.get_weights()]
        out[f"initial_{replicas}"] = [w.tolist() for w in initial]
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.slow
def test_the_training_input_trains_as_its_batches(tmp_path):
    out = tmp_path / "weights.json"
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    proc = subprocess.run([sys.executable, "-c", TRAINING_INPUT_SCRIPT, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = json.loads(out.read_text())
    for replicas in (1, 2):
        assert max_abs_diff(weights[f"initial_{replicas}"], weights[f"training_input_{replicas}"]) > 1e-3
        assert max_abs_diff(weights[f"batches_{replicas}"], weights[f"training_input_{replicas}"]) < 1e-6, replicas
