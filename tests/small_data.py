"""The tiny datasets the tests train on: MNIST's IDX files, a prepared tfds dataset, a cached split."""

# Nothing here reads ../shared or the network; every byte of data is made here, learnable, in the shape and classes
# the configured dataset's DatasetInfo declares (config.Config.dataset). Scripts the tests start import it too
# (cached_split), with tests/ on their PYTHONPATH.

import gzip
import os
import pathlib
import struct

import numpy as np

NUM_TRAIN = 320
NUM_TEST = 64
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---------------------------------------------------------------- IDX writing helpers

def idx_images_bytes(images, count=None):
    """IDX3 of uint8: magic 0x00000803, count, rows, cols (big-endian), then the payload."""
    images = np.asarray(images, np.uint8)
    n = len(images) if count is None else count
    return struct.pack(">IIII", 0x00000803, n, images.shape[1], images.shape[2]) + images.tobytes()


def idx_labels_bytes(labels, count=None):
    """IDX1 of uint8: magic 0x00000801, count (big-endian), then the payload."""
    labels = np.asarray(labels, np.uint8)
    n = len(labels) if count is None else count
    return struct.pack(">II", 0x00000801, n) + labels.tobytes()


def write_gz(path, payload):
    with gzip.open(path, "wb") as f:
        f.write(payload)


def write_idx_dir(directory, arrays):
    """Writes the four standard gzip IDX files for {"train": (images, labels), "test": (...)}, images of one
    channel (MNIST's format)."""
    os.makedirs(directory, exist_ok=True)
    for split, (images, labels) in arrays.items():
        images_name, labels_name = IDX_NAMES[split]
        write_gz(os.path.join(directory, images_name + ".gz"), idx_images_bytes(np.asarray(images)[..., 0]))
        write_gz(os.path.join(directory, labels_name + ".gz"), idx_labels_bytes(labels))
    return str(directory)


# ---------------------------------------------------------------- learnable images, as tfds prepares them

def make_images(labels, rng, image_shape):
    """Each class is a distinct bright block on a 4x4 grid of positions (7x7 pixels in MNIST's 28x28), over
    faint noise, in every channel."""
    height, width, channels = image_shape
    rows, cols = height // 4, width // 4
    images = rng.integers(0, 40, size=(len(labels), height, width, channels), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, row * rows:(row + 1) * rows, col * cols:(col + 1) * cols] = rng.integers(
            200, 256, size=(rows, cols, channels))
    return images


def make_split(n, rng, image_shape=None, num_classes=None):
    """A learnable split of `n` examples: the configured dataset's image shape and classes unless given."""
    if image_shape is None:
        import data  # TensorFlow loads with it, so only once data is made

        image_shape, num_classes = data.image_shape_and_classes()
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.uint8)
    return make_images(labels, rng, image_shape), labels


def dataset_folder(data_dir):
    """Where tfds keeps the configured dataset in `data_dir`: DATA_DIR/NAME/VERSION."""
    from config import Config
    from machinery import tfds_builders

    return pathlib.Path(data_dir) / Config.dataset / str(tfds_builders.builder(Config.dataset).info.version)


def write_dataset(directory, arrays, name=None):
    """`arrays` ({"train": (images, labels), "test": ...}) as a prepared tfds dataset `name` (the configured one
    unless given) in the data dir `directory`; returns the data dir."""
    from config import Config
    from machinery import tfds_builders

    tfds_builders.write_prepared(name or Config.dataset, arrays, str(directory))
    return str(directory)


# ---------------------------------------------------------------- a cached split, without tfds's files

def scaled(images, labels):
    """(images, labels) through data.scale one example at a time, as tf.data's `map` calls it (a user's scale may
    take one example only), batched back into two tensors."""
    import tensorflow as tf

    import data

    examples = tf.data.Dataset.from_tensor_slices((images, labels)).map(data.scale)
    return examples.batch(len(labels)).get_single_element()


def cached_split(images, labels):
    """A training split cached from arrays, as input_engine.open_split caches a split that fits the memory limit:
    each example (uint8 image, int64 label) through data.scale, held in CPU variables. For the tests of the stream,
    whose examples need no tfds files."""
    import tensorflow as tf

    import data
    from machinery import input_engine

    held = scaled(images, labels)
    spec = tuple(tf.TensorSpec(tensor.shape[1:], tensor.dtype) for tensor in held)
    return input_engine.Split(None, "train", data.scale, spec, len(labels), input_engine.held(held))
