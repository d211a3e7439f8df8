"""Another dataset by its name alone, and a split larger than the memory limit streamed.

A dataset of another shape and class count, prepared under a tfds name of its own, trains, evaluates and exports
when the run is given that name and nothing else; and the same run with its splits streamed from disk instead of
held in memory trains to the same accuracy.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from runs import finished
from small_data import make_split, write_dataset

pytestmark = pytest.mark.slow

NAME = "tiny_colour_blocks"  # no tfds dataset: read from the folder it is prepared in
IMAGE_SHAPE, NUM_CLASSES = (32, 32, 3), 5
EPOCHS = 3
FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", "16"]


@pytest.fixture(scope="module")
def colour_data_dir(tmp_path_factory):
    rng = np.random.default_rng(32)
    return write_dataset(tmp_path_factory.mktemp("tfds_colour") / "data",
                         {"train": make_split(240, rng, IMAGE_SHAPE, NUM_CLASSES),
                          "test": make_split(60, rng, IMAGE_SHAPE, NUM_CLASSES)}, name=NAME)


def test_a_dataset_of_another_shape_by_its_name_alone(colour_data_dir, tmp_path):
    output_dir, stdout, results = finished(["--dataset", NAME, "--data-dir", colour_data_dir, *FLAGS,
                                            "--output-dir", str(tmp_path / "colour")], tmp_path)
    assert results["dataset"] == NAME and results["input"] == {"train": "resident", "test": "resident"}
    # The model was built for its images and classes: 32x32x3 in, 5 logits out, and it learned them.
    saved = tf.saved_model.load(str(output_dir / "saved_model")).signatures["serving_default"]
    (spec,) = saved.structured_input_signature[1].values()
    (out,) = saved.structured_outputs.values()
    assert tuple(spec.shape) == (None, *IMAGE_SHAPE) and tuple(out.shape) == (None, NUM_CLASSES)
    accuracies = [results[f"eval_accuracy_{kind}"] for kind in ("checkpoint", "unreplicated", "replicated")]
    assert min(accuracies) > 2 / NUM_CLASSES and max(accuracies) - min(accuracies) < 1e-6, accuracies
    assert os.path.isfile(output_dir / "model.keras")
    assert f"2. data      {NAME}: 240 training and 60 test images (held in memory)" in stdout


def test_streamed_splits_train_as_resident_ones(data_dir, tmp_path):
    """--resident-limit-mb 0 streams both splits from tfds's files each epoch: the same batches in the same order,
    so the same accuracy."""
    runs = {how: finished(["--data-dir", data_dir, *FLAGS, *extra, "--output-dir", str(tmp_path / how)], tmp_path)[2]
            for how, extra in (("resident", []), ("streamed", ["--resident-limit-mb", "0"]))}
    assert runs["resident"]["input"] == {"train": "resident", "test": "resident"}
    assert runs["streamed"]["input"] == {"train": "streamed", "test": "streamed"}
    resident, streamed = (runs[how]["eval_accuracy_checkpoint"] for how in ("resident", "streamed"))
    assert resident > 0.5 and abs(streamed - resident) <= 0.02, (resident, streamed)
