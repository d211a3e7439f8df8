"""The learning-rate schedule, the pixel scaling, MNIST's shape and classes from tfds, the tutorial model's shape
and float32 logits, and --help's options grouped by concern."""

import numpy as np
import pytest
import tensorflow as tf

import callbacks
import data
import model
from config import Config


# ---------------------------------------------------------------- schedule

@pytest.mark.parametrize("epoch, expected", [
    (0, 1e-3), (2, 1e-3),   # epochs 0-2
    (3, 1e-4), (6, 1e-4),   # epochs 3-6
    (7, 1e-5), (11, 1e-5),  # epochs 7 on
])
def test_decay_matches_tutorial_schedule(epoch, expected):
    cfg = Config()
    assert callbacks.decay(epoch, cfg.lr_boundaries, cfg.lr_values) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- scale

def test_scale_maps_uint8_to_unit_float32():
    pixels = tf.constant(np.arange(256, dtype=np.uint8).reshape(16, 16, 1))
    label = tf.constant(7, tf.int64)
    image, out_label = data.scale(pixels, label)
    assert image.dtype == tf.float32
    values = image.numpy()
    assert values.min() >= 0.0 and values.max() <= 1.0
    assert values.flat[0] == 0.0
    assert values.flat[255] == 1.0
    np.testing.assert_allclose(values.ravel(), np.arange(256) / 255.0, rtol=1e-6)
    assert int(out_label) == 7  # the label passes through untouched


# ---------------------------------------------------------------- model

def test_image_shape_and_classes_are_mnists_from_tfds():
    image_shape, num_classes = data.image_shape_and_classes()
    assert image_shape == (28, 28, 1) and num_classes == 10


def test_tutorial_model_layer_shapes_and_parameter_count():
    net = model.build_model(*data.image_shape_and_classes())
    shapes = [tuple(layer.output_shape) for layer in net.layers]
    assert shapes == [(None, 26, 26, 32), (None, 13, 13, 32), (None, 5408), (None, 64), (None, 10)]

    independent = (3 * 3 * 1 + 1) * 32 + (13 * 13 * 32 + 1) * 64 + (64 + 1) * 10
    assert independent == 347146
    assert net.count_params() == 347146
    assert net.count_params() == independent


def test_model_outputs_float32_logits_for_a_batch():
    image_shape, num_classes = data.image_shape_and_classes()
    net = model.build_model(image_shape, num_classes)
    out = net(np.zeros((3, *image_shape), np.float32))
    assert tuple(out.shape) == (3, num_classes) and out.dtype == tf.float32


def test_help_groups_every_option_by_concern(capsys):
    """--help shows each option once, under its concern's heading, in the order Config declares the groups."""
    import dataclasses
    import re

    import config
    import train_mnist_mirrored

    with pytest.raises(SystemExit) as exit_info:
        train_mnist_mirrored.main(["--help"])
    assert exit_info.value.code == 0
    # argparse prints each group as a heading line ending in ':' and then its options, one "  --flag" line each.
    shown, heading = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
        for flag in re.findall(r"^  (--[a-z-]+)", line):
            shown.setdefault(flag, []).append(heading)
    groups = list(dict.fromkeys(f.metadata["group"] for f in dataclasses.fields(Config) if "help" in f.metadata))
    assert groups[:3] == [config.TRAINING, config.DATA, config.CLUSTER]
    for field in dataclasses.fields(Config):
        if "help" in field.metadata:
            assert shown.pop("--" + field.name.replace("_", "-")) == [field.metadata["group"]], field.name
    assert shown == {}  # no option that Config does not declare
