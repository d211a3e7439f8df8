"""Tutorial step 2: the dataset through tensorflow_datasets, scaled to [0, 1], shuffled and batched.

The dataset is config.Config.dataset (`--dataset`), mnist unless changed: any tfds image classification dataset
with `image` and `label` features, its images' shape and its classes read from its DatasetInfo. Offline, `--idx-dir`
(or `python prepare_mnist.py`) prepares an MNIST-format one from its four IDX files first.

`load`, `scale`, `shuffle` and `batch` are the tutorial's pipeline. The input engine below (machinery/
input_engine.py) makes what `fit` and `evaluate` read from them: a split that fits `--resident-limit-mb` held in
memory beside the model and gathered inside the train step, a larger one streamed from tfds's files every epoch.
"""

import tensorflow as tf
import tensorflow_datasets as tfds

import config
import prepare_mnist
from machinery import input_engine, tfds_builders
from machinery.exits import UsageError

FEATURES = ("image", "label")  # what the model trains on, as tfds's supervised image datasets name them


# ---------------------------------------------------------------- the tutorial's pipeline

def load(name, data_dir=None, idx_dir=None):
    """Tutorial: `tfds.load(name, with_info=True)`, for its DatasetInfo: the input engine reads the prepared record
    files itself. Fails fast offline; with `idx_dir`, a data dir that holds no prepared `name` is prepared from
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
    """What a model of this data is built for, from tfds's DatasetInfo: the image shape (height, width, channels)
    and the number of classes. Without `info`, the configured dataset's builder gives them without any data."""
    info = tfds_builders.declared_info(config.Config.dataset) if info is None else info
    return info.features["image"].shape, info.features["label"].num_classes


def scale(image, label):
    """Tutorial: pixels from uint8 [0, 255] to float32 [0, 1]."""
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


def shuffle(examples, *, buffer_size, seed):
    """Tutorial: `shuffle(BUFFER_SIZE)`, seeded: each epoch's order has a seed of its own (the run's seed plus the
    epoch's number), so that every run, resumed or not, sees the same order."""
    return examples.shuffle(buffer_size, seed=seed, reshuffle_each_iteration=False)


def batch(examples, global_batch):
    """Tutorial: `batch(BATCH_SIZE)`, the global batch: the batch per replica times the replicas in sync."""
    return examples.batch(global_batch)


RECIPE = input_engine.Recipe(scale=scale, shuffle=shuffle, batch=batch)


# ---------------------------------------------------------------- what fit and evaluate read

def split(info, name, *, limit_mb):
    """One split, held in memory when its images take at most `limit_mb` MB, else streamed (input_engine.Split)."""
    return input_engine.open_split(info, name, limit_mb=limit_mb)


def training_input(strategy, model, train, stream):
    """What `fit` reads: the `stream`'s batches of the training split (resume.Plan.stream), shuffled and batched
    by the recipe above, across the strategy's replicas (input_engine.training_input)."""
    return input_engine.training_input(strategy, model, train, stream, RECIPE)


def eval_input(strategy, test, *, global_batch):
    """What each evaluation reads: the test split, scaled, in batches of `global_batch`."""
    return input_engine.eval_input(strategy, test, RECIPE, global_batch=global_batch)


def tutorial_datasets(name, data_dir, *, buffer_size, global_batch):
    """The tutorial's pipeline exactly as it writes it, through tfds's own reader: the benchmark's baseline, and
    what the tests check the engine's batches against."""
    datasets = tfds.load(name, data_dir=data_dir, as_supervised=True)
    train = datasets["train"].map(scale).cache().shuffle(buffer_size).batch(global_batch)
    test = datasets["test"].map(scale).batch(global_batch)
    return train, test
