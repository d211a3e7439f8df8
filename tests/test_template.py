"""The template carried to what users change: in a copy of the project, model.py or data.py edited as a user edits
them (a subclassed model with BatchNormalization and Dropout, one-hot labels with a categorical loss and a
per-example augmentation of training examples, together; a dataset of images of varying size resized in `scale`),
and the whole command run to its end: it trains, restores, evaluates and exports, and the three accuracies agree."""

import shutil

import numpy as np
import pytest
import tensorflow as tf

from processes import ROOT, assert_refused_in_one_line, run_entrypoint
from runs import finished
from small_data import make_images

pytestmark = pytest.mark.slow

# What a user's copy holds: the product, without the tests, docs and tools around it.
NOT_COPIED = shutil.ignore_patterns(".git", "tests", "docs", "deploy", "benchmarks", "__pycache__", ".pytest_cache")
FLAGS = ["--epochs", "2", "--batch-size-per-replica", "16"]
ACCURACIES = ("eval_accuracy_checkpoint", "eval_accuracy_unreplicated", "eval_accuracy_replicated")

SUBCLASSED_MODEL = '''
class CNN(keras.Model):
    """The tutorial's CNN as a subclass, with batch normalization and dropout."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(32, 3, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.pool = keras.layers.MaxPooling2D()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(64, activation="relu")
        self.dropout = keras.layers.Dropout(0.2)
        self.logits = keras.layers.Dense(num_classes, dtype="float32")

    def call(self, images, training=False):
        x = self.pool(self.norm(self.conv(images), training=training))
        return self.logits(self.dropout(self.hidden(self.flatten(x)), training=training))


def build_model(image_shape, num_classes):
    return CNN(num_classes)


def tutorial_build_model('''

AUGMENT = '''
def augment(image, label, seed):
    """A shift of up to 2 pixels: pad, then crop back at a random place."""
    assert image.shape.rank == 3, f"augment sees one example, not {image.shape}"
    print("augment: traced for one example of", image.shape)
    height, width, _ = image.shape
    padded = tf.image.resize_with_crop_or_pad(image, height + 4, width + 4)
    return tf.image.stateless_random_crop(padded, tf.shape(image), seed=seed), label
'''


def user_copy(tmp_path, edits):
    """A copy of the project with `edits` ({file: [(old, new), ...]}) made as a user makes them."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=NOT_COPIED)
    for name, replacements in edits.items():
        path = copy / name
        text = path.read_text()
        for old, new in replacements:
            assert old in text, f"{name} no longer holds {old!r}: update this test's edit"
            text = text.replace(old, new, 1)
        path.write_text(text)
    return copy


def finished_copy(copy, tmp_path, args):
    """The copy's whole command to its end (runs.finished); its three accuracies agree."""
    output_dir, stdout, results = finished([*args, "--output-dir", str(tmp_path / "out")], tmp_path,
                                           script=str(copy / "train_mnist_mirrored.py"))
    accuracies = [results[name] for name in ACCURACIES]
    assert max(accuracies) - min(accuracies) < 1e-6, accuracies
    return output_dir, stdout, results


def serving_signature(output_dir):
    saved = tf.saved_model.load(str(output_dir / "saved_model")).signatures["serving_default"]
    (inputs,) = saved.structured_input_signature[1].values()
    (outputs,) = saved.structured_outputs.values()
    return tuple(inputs.shape), tuple(outputs.shape)


def test_a_subclassed_model_one_hot_labels_and_an_augmentation(tmp_path, data_dir):
    """A user's three edits in one copy, run on 2 replicas: model.py's model a subclass with BatchNormalization and
    Dropout, data.py's labels one-hot with a categorical loss, and a per-example augmentation of training examples."""
    from data import image_shape_and_classes

    _, num_classes = image_shape_and_classes()
    copy = user_copy(tmp_path, {
        "model.py": [("\ndef build_model(", SUBCLASSED_MODEL),
                     ("keras.losses.SparseCategoricalCrossentropy(from_logits=True)",
                      "keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)")],
        "data.py": [("    return image, label\n", f"    return image, tf.one_hot(label, {num_classes})\n"),
                    ("\naugment = None\n", AUGMENT)],
    })
    output_dir, stdout, results = finished_copy(copy, tmp_path,
                                                ["--data-dir", data_dir, *FLAGS, "--cpu-replicas", "2"])
    assert results["eval_accuracy_checkpoint"] > 0.3, results
    # The augmentation was traced into the training input for one example at a time (its assert held).
    assert "augment: traced for one example of (" in stdout
    # Built by the run for one scaled example (a subclass makes its variables at its first call), and exported.
    assert results["parameters"] > 0 and (output_dir / "saved_model" / "saved_model.pb").is_file()
    inputs, outputs = serving_signature(output_dir)
    assert inputs[0] is None and len(inputs) == 4 and outputs == (None, num_classes)
    # model.keras where Keras saves it; otherwise the summary says why in one line.
    if results["keras_model_unsaved"] is None:
        assert (output_dir / "model.keras").is_file()
    else:
        assert f"no Keras 3 file: {results['keras_model_unsaved']}" in stdout


VARYING = "tiny_varying_sizes"  # no tfds dataset: read from the folder it is prepared in
VARYING_CLASSES = 4
RESIZED = (24, 24)


@pytest.fixture(scope="module")
def varying_data_dir(tmp_path_factory):
    """A dataset whose images vary in size, each class a block at its place whatever the size."""
    import tensorflow_datasets as tfds

    rng = np.random.default_rng(7)

    def split(count):
        labels = rng.permutation(np.arange(count) % VARYING_CLASSES).astype(np.int64)
        sizes = rng.integers(20, 33, size=(count, 2))
        images = [make_images(labels[i:i + 1], rng, (*sizes[i], 3))[0] for i in range(count)]
        return images, labels

    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(None, None, 3)),
                                           "label": tfds.features.ClassLabel(num_classes=VARYING_CLASSES)})
    from machinery import tfds_builders

    directory = tmp_path_factory.mktemp("varying") / "data"
    tfds_builders.write_prepared(VARYING, {"train": split(240), "test": split(60)}, str(directory), features=features)
    return str(directory)


def test_images_of_varying_size_resized_in_scale(tmp_path, varying_data_dir):
    copy = user_copy(tmp_path, {"data.py": [("    image = tf.cast(image, tf.float32)\n",
                                             f"    image = tf.image.resize(image, {RESIZED})\n")]})
    output_dir, _, results = finished_copy(copy, tmp_path,
                                           ["--dataset", VARYING, "--data-dir", varying_data_dir, *FLAGS])
    # The model is built for what scale yields, not for tfds's (None, None, 3).
    assert serving_signature(output_dir) == ((None, *RESIZED, 3), (None, VARYING_CLASSES))
    assert results["eval_accuracy_checkpoint"] > 2 / VARYING_CLASSES, results


def test_images_of_varying_size_without_a_resize_are_one_line(tmp_path, varying_data_dir):
    output_dir = tmp_path / "out"
    worker = run_entrypoint(["--dataset", VARYING, "--data-dir", varying_data_dir, "--output-dir", str(output_dir)],
                            tmp_path)
    assert_refused_in_one_line(worker.returncode, worker.stderr, ["vary in size", "data.scale", "tf.image.resize"],
                               str(output_dir))
