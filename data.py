"""Tutorial step 2: the dataset through tensorflow_datasets, each example scaled to [0, 1], cached, shuffled and
batched; an augmentation of training examples may join them.

The dataset is config.Config.dataset (`--dataset`), mnist unless changed: any tfds image classification dataset
with `image` and `label` features. Offline, `--idx-dir` (or `python prepare_mnist.py`) prepares an MNIST-format one
from its four IDX files first.

`scale` and `augment` are yours: each sees one example, as `Dataset.map` calls it, and what `scale` returns (a
resized image, one-hot labels, several features) is what the model is built for (`model_input`). The steps below
read as the tutorial's pipeline; the input engine under them (machinery/input_engine.py) keeps each epoch's order
exact at any resume and on any number of replicas, caches a split that fits `--resident-limit-mb` and streams a
larger one from tfds's files.
"""

import tensorflow as tf
import tensorflow_datasets as tfds

import config
import prepare_mnist
from machinery import input_engine, tfds_builders
from machinery.exits import UsageError

FEATURES = (input_engine.IMAGE, input_engine.LABEL)  # what the model trains on, as tfds names them


# ---------------------------------------------------------------- load

def load(name, data_dir=None, idx_dir=None):
    """Tutorial: `tfds.load(name, with_info=True)`, its DatasetInfo here, its examples split by split (`split`).
    Fails fast offline; with `idx_dir`, a data dir that holds no prepared `name` is prepared from
    the IDX files there first."""
    if data_dir is not None and not tf.io.gfile.isdir(data_dir) and idx_dir is None:
        raise UsageError(f"--data-dir {data_dir} does not exist; {prepare_mnist.hint(name, data_dir)}")
    builder = tfds_builders.builder(name, data_dir)
    if not tfds_builders.is_prepared(builder):
        if idx_dir is not None:
            prepare_mnist.prepare(idx_dir, data_dir, name=name, exist_ok=True)
        elif not tfds_builders.online():
            raise UsageError(f"no prepared {name} in {data_dir or builder.data_dir} and no internet to download it; "
                             f"{prepare_mnist.hint(name, data_dir or '~/tensorflow_datasets')}")
    try:
        # download_and_prepare does nothing for a prepared dir, and downloads (as tfds.load does) otherwise.
        builder = tfds_builders.builder(name, data_dir)
        builder.download_and_prepare()
    except (OSError, ValueError, AssertionError, tf.errors.OpError) as err:
        raise UsageError(f"the {name} dataset in {data_dir or builder.data_dir} cannot be read "
                         f"({type(err).__name__}); prepare it again into an empty dir and pass that as --data-dir") from None
    return checked(builder.info)


def checked(info):
    """`info`, once it is known to hold what the run trains on: images and their labels, a train and a test split."""
    missing = [name for name in FEATURES if name not in info.features] + [
        split for split in ("train", "test") if split not in info.splits]
    if missing:
        raise UsageError(f"the {info.name} dataset has no {', '.join(missing)} (it has features "
                         f"{', '.join(info.features)} and splits {', '.join(info.splits)}); choose an image "
                         "classification --dataset with image and label features and train and test splits")
    return info


def image_shape_and_classes(info=None):
    """The images as tfds stores them, before `scale`: their shape (height, width, channels; None where they vary)
    and the number of classes, from DatasetInfo. Without `info`, the configured dataset's builder gives them
    without any data."""
    info = tfds_builders.declared_info(config.Config.dataset) if info is None else info
    return info.features[input_engine.IMAGE].shape, info.features[input_engine.LABEL].num_classes


# ---------------------------------------------------------------- scale, and augment: one example each

def scale(image, label):
    """Tutorial: pixels from uint8 [0, 255] to float32 [0, 1]."""
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


# The tutorial augments nothing. An `augment(image, label, seed)` here is applied to each training example after
# the shuffle, every epoch anew; `seed` is the example's own, for tf.image's stateless_random_* ops, so that a
# resumed run augments as one never stopped (README, "Another dataset").
augment = None


# ---------------------------------------------------------------- cache, shuffle, batch

def split(info, name, *, limit_mb):
    """Tutorial: `map(scale)`, then `cache()`: the split's examples scaled, held in memory when they take at most
    `limit_mb` MB, else streamed from tfds's files each epoch (input_engine.Split)."""
    return input_engine.open_split(info, name, scale, limit_mb=limit_mb)


def model_input(train, info):
    """What the model is built for: one scaled example's features' shape (a nest of shapes for several features),
    and the dataset's number of classes."""
    features = train.element_spec[0]
    return (tf.nest.map_structure(lambda spec: tuple(spec.shape), features),
            info.features[input_engine.LABEL].num_classes)


def training_input(strategy, train, stream):
    """Tutorial: `shuffle(BUFFER_SIZE)` seeded anew each epoch, `augment`, `batch(BATCH_SIZE)` of the global batch,
    across the strategy's replicas: the `stream`'s batches (resume.Plan.stream), from the first image not trained."""
    return input_engine.training_input(strategy, train, stream, augment=augment)


def eval_input(strategy, test, *, global_batch):
    """What each evaluation reads: the test split, scaled, in batches of `global_batch`."""
    return input_engine.eval_input(strategy, test, global_batch=global_batch)


def tutorial_datasets(name, data_dir, *, buffer_size, global_batch):
    """The tutorial's pipeline exactly as it writes it, through tfds's own reader: the benchmark's baseline, and
    what the tests check the engine's batches against."""
    datasets = tfds.load(name, data_dir=data_dir, as_supervised=True)
    train = datasets["train"].map(scale).cache().shuffle(buffer_size).batch(global_batch)
    test = datasets["test"].map(scale).batch(global_batch)
    return train, test
