"""Tutorial step 2: MNIST through tensorflow_datasets, scaled to [0, 1], shuffled and batched.

MNIST comes only from tfds's prepared `mnist` (found and checked by tfds's builder, its record files then read
once into memory by `resident_split`). For machines without internet,
`python data.py prepare --idx-dir DIR [--data-dir DIR]` turns the four standard IDX files into a prepared
tfds data dir with tfds's own builder (so tfds writes, versions and names the files), after which
`tfds.load('mnist', data_dir=DIR)` reads it with no network access.
"""

import argparse
import contextlib
import fcntl
import functools
import gzip
import math
import os
import socket
import sys
import threading

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.image_classification import mnist as tfds_mnist

from config import EXIT_BAD_INPUT, EXIT_OK, UsageError

IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic numbers: unsigned bytes, 3 dimensions (images) or 1 (labels).
IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}
DOWNLOAD_HOST = ("storage.googleapis.com", 443)  # where tfds downloads MNIST from
ONLINE_PROBE_SECONDS = 3
PREPARE_HINT = "python data.py prepare --idx-dir DIR_WITH_IDX_FILES"
PREPARE_LOCK = ".mnist-prepare.lock"  # in the data dir; tfds ignores it
READ_BATCH = 1024  # records parsed per vectorised tf.io.parse_example call
WHOLE = (0, 1)  # an input pipeline's share of each global batch: the first of one, all of it
PADDING = -1  # the index of a padding example in a batch of indices: image 0, at weight 0 (`padded`)


# ---------------------------------------------------------------- IDX files -> prepared tfds dir

def _idx_path(idx_dir, name):
    for candidate in (os.path.join(idx_dir, name + ".gz"), os.path.join(idx_dir, name)):
        if os.path.isfile(candidate):
            return candidate
    raise UsageError(f"{name}(.gz) is missing from {idx_dir}; put the four standard MNIST IDX files there")


def read_idx(path, ndim):
    """Reads one IDX file (gzip or raw) of unsigned bytes with `ndim` dimensions, checking every size."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise UsageError(f"{path} cannot be read ({err}); replace it with an intact copy") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"{path} is empty or shorter than an IDX header; replace it with an intact copy")
    magic = int.from_bytes(raw[:4], "big")
    if magic != IDX_MAGIC[ndim]:
        raise UsageError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (magic {magic:#010x}); "
                         "check that images and labels are not swapped")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) - header != math.prod(dims):
        raise UsageError(f"{path} holds {len(raw) - header} bytes of data but its header promises "
                         f"{math.prod(dims)} ({' x '.join(map(str, dims))}); it is truncated or corrupt, replace it")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def read_split(idx_dir, split):
    images_name, labels_name = IDX_FILES[split]
    images = read_idx(_idx_path(idx_dir, images_name), 3)
    labels = read_idx(_idx_path(idx_dir, labels_name), 1)
    if images.shape[1:] != IMAGE_SHAPE:
        raise UsageError(f"{images_name} holds {images.shape[1]}x{images.shape[2]} images, not MNIST's 28x28")
    if len(images) != len(labels):
        raise UsageError(f"{images_name} has {len(images)} images but {labels_name} has {len(labels)} labels; "
                         "use files from the same MNIST release")
    if len(images) == 0:
        raise UsageError(f"{images_name} holds no images; replace it with the real file")
    if labels.max() >= NUM_CLASSES:
        raise UsageError(f"{labels_name} has label {labels.max()}, MNIST's are 0-{NUM_CLASSES - 1}; replace it")
    return images, labels


class _MnistFromIdx(tfds_mnist.MNIST, skip_registration=True):
    """tfds's own MNIST builder (same name, version, features), fed from local IDX arrays instead of a download."""

    name = "mnist"

    def __init__(self, *, splits, **kwargs):
        self._arrays = splits
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(*arrays) for split, arrays in self._arrays.items()}

    def _generate_examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels)):
            yield index, {"image": image[..., None], "label": int(label)}

    def _log_download_bytes(self):
        """tfds's "Downloading and preparing dataset Unknown size ..." line: nothing is downloaded here, and
        prepare() has said what it does."""

    def _log_download_done(self):
        print(f"prepared mnist in {self.data_dir}", flush=True)


def _is_prepared(builder):
    """builder.is_prepared(), without its warning that a dataset folder not yet made "has no dataset_info.json"
    (a first offline run printed it twice); a folder that exists without that file still warns."""
    return builder.data_path.exists() and builder.is_prepared()


@contextlib.contextmanager
def _prepare_lock(data_dir):
    """Runs started together on one (shared) data dir take turns to prepare it: one writes, the others wait."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, PREPARE_LOCK)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process preparing mnist in {data_dir} (it holds {path})", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


def prepare(idx_dir, data_dir=None, *, exist_ok=False):
    """Writes a prepared `mnist` tfds dataset under data_dir from the IDX files in idx_dir; returns its path.

    With `exist_ok`, a data dir that another process prepared meanwhile is simply used.
    """
    if not os.path.isdir(idx_dir):
        raise UsageError(f"--idx-dir {idx_dir} is not a directory; point it at the folder with the MNIST IDX files")
    splits = {split: read_split(idx_dir, split) for split in IDX_FILES}
    root = data_dir or os.path.dirname(os.path.dirname(tfds.builder("mnist").data_dir))  # tfds's own default
    with _prepare_lock(root):
        # Made under the lock, so that it sees what a prepare that held the lock before wrote.
        builder = _MnistFromIdx(splits=splits, data_dir=data_dir)
        if _is_prepared(builder):
            if exist_ok:
                return builder.data_dir
            raise UsageError(f"{builder.data_dir} already holds a prepared mnist; remove it first to prepare it again")
        print(f"preparing mnist in {root} from the IDX files in {idx_dir}", flush=True)
        # tfds writes into an "incomplete" temporary folder and renames it when done, so a killed prepare
        # leaves no half-written dataset behind.
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder.data_dir


# ---------------------------------------------------------------- loading, as the tutorial does

def _online():
    """True when tfds's download host answers within a few seconds (DNS included)."""
    result = []

    def probe():
        try:
            socket.create_connection(DOWNLOAD_HOST, timeout=ONLINE_PROBE_SECONDS).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(ONLINE_PROBE_SECONDS)
    return bool(result)


def load(data_dir=None, idx_dir=None):
    """Tutorial: `tfds.load('mnist', with_info=True)`, for its DatasetInfo only: the run reads the record files
    itself (resident_split), so it never builds tfds's datasets. Fails fast offline.

    With `idx_dir`, a data dir that holds no prepared mnist is prepared from the IDX files first.
    """
    if data_dir is not None and not os.path.isdir(data_dir) and idx_dir is None:
        raise UsageError(f"--data-dir {data_dir} does not exist; prepare it with: {PREPARE_HINT} --data-dir {data_dir}")
    builder = tfds.builder("mnist", data_dir=data_dir)
    if not _is_prepared(builder):
        if idx_dir is not None:
            prepare(idx_dir, data_dir, exist_ok=True)
        elif not _online():
            raise UsageError(f"no prepared mnist in {data_dir or builder.data_dir} and no internet to download it; "
                             f"run: {PREPARE_HINT} --data-dir {data_dir or '~/tensorflow_datasets'}, "
                             "or pass --idx-dir DIR_WITH_IDX_FILES")
    try:
        # download_and_prepare does nothing for a prepared dir, and downloads (as tfds.load does) otherwise.
        builder = tfds.builder("mnist", data_dir=data_dir)
        builder.download_and_prepare()
        return builder.info
    except (OSError, ValueError, AssertionError, tf.errors.OpError) as err:
        raise _unreadable(data_dir or builder.data_dir, type(err).__name__) from None


def resident_split(info, split):
    """One split of the prepared tfds dataset as two in-memory tensors, in tfds's record order.

    tfds's own reader parses one example at a time (about 5 CPU-seconds for the 60,000 training images here);
    reading its record files in vectorised batches and decoding with tfds's image feature in parallel costs a
    third of that. Returns images (N, 28, 28, 1) uint8 and labels (N,) int64, as `tfds.load(...,
    as_supervised=True)` yields them.
    """
    serialized = info.features.get_serialized_info()
    spec = {name: tf.io.FixedLenFeature(tensor.shape, tensor.tf_dtype) for name, tensor in serialized.items()}
    image = info.features["image"]

    def decode(records):
        example = tf.io.parse_example(records, spec)
        images = tf.map_fn(image.decode_example, example["image"],
                           fn_output_signature=tf.TensorSpec(image.shape, image.tf_dtype))
        return images, example["label"]

    files = [os.path.join(info.data_dir, name) for name in info.splits[split].filenames]
    records = tf.data.TFRecordDataset(files).batch(READ_BATCH)
    batches = _untuned(records.map(decode, num_parallel_calls=os.cpu_count() or 1))
    try:
        parts = list(batches)
    except tf.errors.OpError as err:
        raise _unreadable(info.data_dir, type(err).__name__) from None
    images, labels = tf.concat([p[0] for p in parts], 0), tf.concat([p[1] for p in parts], 0)
    # A record file cut short reads as a shorter one, without an error.
    if len(labels) != info.splits[split].num_examples:
        raise _unreadable(info.data_dir, f"{len(labels)} of {info.splits[split].num_examples} {split} examples")
    return images, labels


def _unreadable(data_dir, why):
    return UsageError(f"the mnist dataset in {data_dir} cannot be read ({why}); "
                      f"prepare it again into an empty dir: {PREPARE_HINT} --data-dir NEW_DIR")


def scale(image, label):
    """Tutorial: pixels from uint8 [0, 255] to float32 [0, 1]."""
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


def steps_per_epoch(num_examples, global_batch, limit=None):
    steps = math.ceil(num_examples / global_batch)
    return min(steps, limit) if limit else steps


def images_per_epoch(steps, global_batch, num_examples):
    """Images one epoch of `steps` batches trains on: only an epoch's last batch can be short."""
    return min(steps * global_batch, num_examples)


def _untuned(dataset):
    """Turns tf.data's autotuner off: destroying an iterator waits for its tuning thread, which made `fit`
    return 3-50 s after its last epoch (measured with `py-spy dump --native`: ~IteratorResource waiting in
    UnboundedThreadPool). These pipelines gather whole batches from memory and have nothing to tune."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def untune_device_pipelines():
    """Turns the autotuner off in the device-side pipelines TensorFlow's multi-device iterator builds for each
    replica, as `_untuned` does for ours: they are built with tf.data's default options, which nothing passed
    to a strategy or to Keras reaches, and destroying one waits for its tuning thread's next round. That made a
    two-worker `fit` return 17 s after its last epoch (300-step epochs, 2026-12-03; the wait grows with the run,
    up to the tuner's 60 s period), and every evaluation's end wait too. Each pipeline only prefetches one batch
    into a fixed buffer, so there is nothing to tune. TensorFlow's private `_create_device_dataset` is wrapped;
    should a later TensorFlow drop it, runs go on with the wait (tests/test_input_pipeline.py notices)."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if create is None or getattr(create, "untuned", False):
        return

    def create_untuned(*args, **kwargs):
        return _untuned(create(*args, **kwargs))

    create_untuned.untuned = True
    multi_device_iterator_ops._create_device_dataset = create_untuned


def for_distribution(dataset):
    options = tf.data.Options()
    # MNIST is one file per split, so multi-worker sharding must split examples, not files.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return _untuned(dataset.with_options(options))


def distribute(strategy, make_dataset):
    """What `fit` is given: the training stream across the strategy's replicas, from `make_dataset(share=...)`,
    which builds the stream of one input pipeline's share of every global batch (`pipeline_share`).

    Keras hands a plain dataset to the strategy's multi-device iterator, which copies each batch to its
    replica's device from a background thread through a device-side pipeline of tf.data's default options.
    Its autotuner thread ignores the iterator's teardown until its next tuning round: `fit` returned up to
    6.5 s after its last epoch, in 2 of 4 runs of 3 epochs (docs/performance.md); evaluation's short-lived
    iterators are left to Keras, which also wants a step count for anything else. Under multi-worker, Keras's
    path also has every worker gather and scale the whole global batch, rebatch it and keep only its own part.

    So a single replica of MirroredStrategy, which has nothing to split, reads the stream through the strategy's
    own per-replica input (no fetch to a device, no multi-device iterator, no autotuner), one batch read ahead.
    Under MultiWorkerMirroredStrategy with one replica per worker, each worker's input pipeline gathers only
    its own share of each global batch, split as TensorFlow's rebatching splits it; TensorFlow still puts a
    multi-device iterator behind it (it refuses per-replica input for this strategy). Several replicas in one
    process (several GPUs, --cpu-replicas, workers with several GPUs) keep Keras's path. Wherever a
    multi-device iterator remains, evaluation's included, its device-side pipelines are built untuned
    (`untune_device_pipelines`).
    """
    untune_device_pipelines()
    single = isinstance(strategy, tf.distribute.MirroredStrategy) and strategy.num_replicas_in_sync == 1
    per_worker = (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                  and len(strategy.extended.worker_devices) == 1)
    if not (single or per_worker):
        return make_dataset(share=WHOLE)
    mode = tf.distribute.InputReplicationMode.PER_REPLICA if single else tf.distribute.InputReplicationMode.PER_WORKER
    options = tf.distribute.InputOptions(experimental_replication_mode=mode, experimental_fetch_to_device=False)

    def pipeline(context):
        return make_dataset(share=(context.input_pipeline_id, context.num_input_pipelines)).prefetch(1)

    return strategy.distribute_datasets_from_function(pipeline, options)


def pipeline_share(batch, index, count):
    """Input pipeline `index` of `count`'s part of a global batch of example indices: a contiguous slice, sizes
    differing by at most one, the first pipelines taking the extra examples of a short batch. That is how
    TensorFlow's own rebatching splits a global batch between workers (a last batch of 3 gives 2 and 1; one of 1
    would give 1 and none, but `padded` makes it 1 and a padding example), and each replica's loss is the mean
    over its own examples, so the split decides how much each example of a partial batch weighs in the gradient:
    the same split keeps the same gradients."""
    size = tf.shape(batch, out_type=tf.int64)[0]
    base, extra = size // count, size % count
    start = index * base + tf.minimum(tf.constant(index, tf.int64), extra)
    return batch[start:start + base + tf.cast(index < extra, tf.int64)]


def _gather(images, labels, batch):
    """The scaled images and the labels at a batch of indices of the resident tensors."""
    return scale(tf.gather(images, batch), tf.gather(labels, batch))


def _batches(images, labels, indices):
    return indices.map(lambda batch: _gather(images, labels, batch))


def padded(batch, replicas):
    """A global batch of indices with PADDING appended up to `replicas` indices, so that no replica's share is
    empty: TensorFlow 2.21's oneDNN MaxPoolGrad kernel aborts the process on an empty batch inside a graph, on
    some CPUs (docs/faults.md, "An empty replica batch"; docs/upstream/empty_batch_maxpoolgrad.py reproduces it).

    A batch is split between replicas in contiguous slices differing by at most one (`pipeline_share`), so only a
    batch of fewer examples than replicas is padded, and each of its real examples stays alone on its replica, as
    before. A padding example weighs 0 in its replica's loss (a mean over its one example), so its gradient is
    exactly zero, as an empty replica's was: every step's update is that of its real examples."""
    missing = tf.maximum(tf.cast(replicas, tf.int64) - tf.shape(batch, out_type=tf.int64)[0], 0)
    return tf.concat([batch, tf.fill([missing], tf.constant(PADDING, tf.int64))], 0)


def _weighted_batches(images, labels, indices):
    """`_batches` of index batches that may hold PADDING, each with its examples' weights: 1, or 0 for padding,
    which Keras's `fit` reads as sample weights."""
    def gather(batch):
        real = batch != PADDING
        return (*_gather(images, labels, tf.where(real, batch, 0)), tf.cast(real, tf.float32))

    return indices.map(gather)


def epoch_order(num_examples, *, buffer_size, seed, epoch):
    """Epoch `epoch`'s order of the training split's indices: the tutorial's shuffle through a buffer of
    `buffer_size`, seeded by the epoch's number, so that every run, resumed or not, sees the same order."""
    return tf.data.Dataset.range(num_examples).shuffle(buffer_size, seed=seed + epoch, reshuffle_each_iteration=False)


def index_batches(num_examples, *, buffer_size, seed, global_batch, first_epoch, first_image, epoch_images, epochs):
    """The batches of training indices from image `first_image` of epoch `first_epoch` to the end of epoch
    `epochs` - 1 (resume.Plan gives the position).

    Each epoch is the first `epoch_images` of its order (all of it, unless --steps-per-epoch cuts it),
    batched from its own first image, or from `first_image` for the epoch a resumed run finishes; an
    epoch's last batch holds what is left of it, so it may be short, and no batch spans two epochs.
    """
    def one_epoch(epoch):
        first = first_image if epoch == first_epoch else 0
        order = epoch_order(num_examples, buffer_size=buffer_size, seed=seed, epoch=epoch)
        return order.take(epoch_images).skip(first).batch(global_batch)

    # One dataset per epoch, chained in Python: each shuffle's seed is then a number, not a tensor, which
    # TensorFlow's seeding cannot compare with 0 when the global seed is 0 (`--seed 0` failed to trace).
    nothing = tf.data.Dataset.range(0).batch(global_batch)
    return functools.reduce(tf.data.Dataset.concatenate, map(one_epoch, range(first_epoch, epochs)), nothing)


def train_dataset(images, labels, *, buffer_size, global_batch, seed, first_epoch, first_image, epoch_images, epochs,
                  replicas=1, share=WHOLE):
    """All batches from image `first_image` of epoch `first_epoch` on, gathered from the resident training split;
    with `share` (index, count), only that input pipeline's part of each (`pipeline_share`). Across several
    `replicas` (all workers' together) a batch smaller than their count is `padded`, and every batch carries
    its examples' weights.

    The tutorial's `map(scale).cache().shuffle(buffer).batch(batch)` shuffles examples through a buffer of
    `buffer_size`; here the same seeded shuffle runs over example indices (`index_batches`), which gives the
    same order (tf.data's shuffle draws positions in its buffer, whatever the elements are), and each batch
    is gathered from memory. Each epoch's shuffle is seeded by its number, so a run resumed at any image,
    at any global batch, trains exactly the images an uninterrupted run trains from there on.
    """
    indices = index_batches(int(images.shape[0]), buffer_size=buffer_size, seed=seed, global_batch=global_batch,
                            first_epoch=first_epoch, first_image=first_image, epoch_images=epoch_images,
                            epochs=epochs)
    if replicas > 1:
        indices = indices.map(lambda batch: padded(batch, replicas))
    if share != WHOLE:
        indices = indices.map(lambda batch: pipeline_share(batch, *share))
    batches = _weighted_batches if replicas > 1 else _batches
    # Repeated so that the stream never ends under `fit`, which stops after its epochs by itself.
    return for_distribution(batches(images, labels, indices.repeat()))


def eval_dataset(images, labels, *, global_batch):
    indices = tf.data.Dataset.range(int(images.shape[0])).batch(global_batch)
    return for_distribution(_batches(images, labels, indices))


def tfds_datasets(data_dir=None):
    """tfds's own per-example datasets, as the tutorial's `tfds.load('mnist', as_supervised=True)` gives them;
    for the benchmark's baseline and the tests that compare against it, not the run."""
    return tfds.load("mnist", data_dir=data_dir, as_supervised=True)


def tutorial_datasets(datasets, *, buffer_size, global_batch):
    """The tutorial's pipeline exactly as it writes it; the benchmark's baseline."""
    train = datasets["train"].map(scale).cache().shuffle(buffer_size).batch(global_batch)
    test = datasets["test"].map(scale).batch(global_batch)
    return train, test


# ---------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(prog="data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="turn the four MNIST IDX files into a prepared tfds data dir")
    prep.add_argument("--idx-dir", required=True, help="folder holding train-images-idx3-ubyte(.gz) and the other three")
    prep.add_argument("--data-dir", default=None, help="tfds data dir to write (default: tfds's own)")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.idx_dir, args.data_dir)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"prepared mnist in {path}; train with: python train_mnist_mirrored.py --data-dir {args.data_dir or '~/tensorflow_datasets'}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
