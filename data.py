"""Tutorial step 2: MNIST through tensorflow_datasets, scaled to [0, 1], shuffled and batched.

MNIST comes only from tfds's prepared `mnist`, found and checked by tfds's builder; its record files are then read
once into memory (`resident_split`). Without internet, `--idx-dir` (or `python prepare_mnist.py`) prepares it from
the four IDX files first.

Training keeps the split resident on every replica's device and sends only each batch's example indices through
tf.data: the step itself gathers and scales its batch, as fast small-image trainers do, so no batch of images
crosses a thread or a device boundary. `training_input` is the one call that wires both sides.
"""

import dataclasses
import functools
import math
import os
import socket
import threading
import typing

import tensorflow as tf
import tensorflow_datasets as tfds

import prepare_mnist
from machinery import tf_private
from config import UsageError

DOWNLOAD_HOST = ("storage.googleapis.com", 443)  # where tfds downloads MNIST from
ONLINE_PROBE_SECONDS = 3
READ_BATCH = 1024  # records parsed per vectorised tf.io.parse_example call
WHOLE = (0, 1)  # an input pipeline's share of each global batch: the first of one, all of it
PADDING = -1  # the index of a padding example in a batch of indices: image 0, at weight 0 (`padded`)


@dataclasses.dataclass(frozen=True)
class Stream:
    """Which training batches a run reads, as example indices. Each epoch trains the first `epoch_images` of its
    own seeded order of the split's `num_examples` indices (`epoch_order`; all of them when None), in batches of
    `global_batch`; the stream starts at image `first_image` of epoch `first_epoch` and ends with epoch
    `epochs` - 1. A run takes its stream from its resume plan (resume.Plan.stream)."""

    num_examples: int
    global_batch: int
    buffer_size: int
    seed: int
    epochs: int
    first_epoch: int = 0
    first_image: int = 0
    epoch_images: typing.Optional[int] = None

    @property
    def images_an_epoch(self):
        return self.num_examples if self.epoch_images is None else self.epoch_images


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


def mnist_info(data_dir=None, idx_dir=None):
    """Tutorial: `tfds.load('mnist', with_info=True)`, for its DatasetInfo only: the run reads the record files
    itself (resident_split), so it never builds tfds's datasets. Fails fast offline.

    With `idx_dir`, a data dir that holds no prepared mnist is prepared from the IDX files first.
    """
    if data_dir is not None and not os.path.isdir(data_dir) and idx_dir is None:
        raise UsageError(f"--data-dir {data_dir} does not exist; prepare it with: {prepare_mnist.HINT} --data-dir {data_dir}")
    builder = prepare_mnist.made_tidily(tfds.builder, "mnist", data_dir=data_dir)
    if not prepare_mnist.is_prepared(builder):
        if idx_dir is not None:
            prepare_mnist.prepare(idx_dir, data_dir, exist_ok=True)
        elif not _online():
            raise UsageError(f"no prepared mnist in {data_dir or builder.data_dir} and no internet to download it; "
                             f"run: {prepare_mnist.HINT} --data-dir {data_dir or '~/tensorflow_datasets'}, "
                             "or pass --idx-dir DIR_WITH_IDX_FILES")
    try:
        # download_and_prepare does nothing for a prepared dir, and downloads (as tfds.load does) otherwise.
        builder = prepare_mnist.made_tidily(tfds.builder, "mnist", data_dir=data_dir)
        builder.download_and_prepare()
        return builder.info
    except (OSError, ValueError, AssertionError, tf.errors.OpError) as err:
        raise _unreadable(data_dir or builder.data_dir, type(err).__name__) from None


def image_shape_and_classes(info=None):
    """What a model of this data is built for, from tfds's DatasetInfo: the image shape (height, width, channels)
    and the number of classes. Without `info`, mnist's builder gives them without any data."""
    info = _builder_info() if info is None else info
    return info.features["image"].shape, info.features["label"].num_classes


@functools.lru_cache(maxsize=1)
def _builder_info():
    """mnist's DatasetInfo as its builder declares it, with no data."""
    return prepare_mnist.made_tidily(tfds.builder, "mnist").info


def resident_split(info, split):
    """One split of the prepared tfds dataset as two in-memory tensors, in tfds's record order.

    tfds's own reader parses one example at a time (about 5 CPU-seconds for the 60,000 training images here);
    reading its record files in vectorised batches and decoding with tfds's image feature in parallel costs a
    third of that. Returns images (N, height, width, channels) uint8 and labels (N,) int64, as `tfds.load(...,
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
                      f"prepare it again into an empty dir: {prepare_mnist.HINT} --data-dir NEW_DIR")


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
    replica, as `_untuned` does for ours: they take tf.data's default options, and destroying one waits for its
    tuning thread's next round, which made a two-worker `fit` return many seconds after its last epoch (up to the
    tuner's 60 s period), and every evaluation's end wait too. Each only prefetches one batch into a fixed buffer,
    so there is nothing to tune. Should a later TensorFlow drop the private function this wraps, runs go on with
    the wait (tf_private.wrap_device_datasets, and its canary)."""
    tf_private.wrap_device_datasets(_untuned)


def for_distribution(dataset):
    options = tf.data.Options()
    # MNIST is one file per split, so multi-worker sharding must split examples, not files.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return _untuned(dataset.with_options(options))


def distribute(strategy, make_dataset):
    """What `fit` is given: the training stream across the strategy's replicas, from `make_dataset(share=...)`,
    which builds the stream of one input pipeline's share of every global batch (`pipeline_share`).

    A single replica of MirroredStrategy, which has nothing to split, reads the stream through the strategy's own
    per-replica input, one batch read ahead: no multi-device iterator, whose device-side pipeline and its
    autotuner stalled the end of `fit`. Under MultiWorkerMirroredStrategy with one replica per worker, each
    worker's pipeline makes only its own share of each global batch, split as TensorFlow's rebatching splits it
    (TensorFlow refuses per-replica input there and keeps a multi-device iterator). Several replicas in one
    process (GPUs, --cpu-replicas) keep Keras's path. Wherever a multi-device iterator remains, evaluation's
    included, its device-side pipelines are built untuned (`untune_device_pipelines`).
    """
    untune_device_pipelines()
    single = _single_replica(strategy)
    per_worker = (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                  and len(strategy.extended.worker_devices) == 1)
    if not (single or per_worker):
        return make_dataset(share=WHOLE)
    mode = tf.distribute.InputReplicationMode.PER_REPLICA if single else tf.distribute.InputReplicationMode.PER_WORKER

    def pipeline(context):
        return make_dataset(share=(context.input_pipeline_id, context.num_input_pipelines)).prefetch(1)

    return strategy.distribute_datasets_from_function(pipeline, _input_options(mode))


def _single_replica(strategy):
    return isinstance(strategy, tf.distribute.MirroredStrategy) and strategy.num_replicas_in_sync == 1


def _input_options(mode):
    return tf.distribute.InputOptions(experimental_replication_mode=mode, experimental_fetch_to_device=False)


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


def examples(images, labels, batch, *, weighted):
    """The scaled images and the labels at a batch of indices into a resident split; `weighted`, for batches
    that may hold PADDING, adds each example's weight (1, or 0 for padding), which Keras reads as sample weights."""
    if not weighted:
        return scale(tf.gather(images, batch), tf.gather(labels, batch))
    real = batch != PADDING
    batch = tf.where(real, batch, tf.zeros_like(batch))
    return (*scale(tf.gather(images, batch), tf.gather(labels, batch)), tf.cast(real, tf.float32))


def epoch_order(num_examples, *, buffer_size, seed, epoch):
    """Epoch `epoch`'s order of the training split's indices: the tutorial's shuffle through a buffer of
    `buffer_size`, seeded by the epoch's number, so that every run, resumed or not, sees the same order."""
    return tf.data.Dataset.range(num_examples).shuffle(buffer_size, seed=seed + epoch, reshuffle_each_iteration=False)


def index_batches(stream):
    """The `stream`'s batches of training indices.

    Each epoch is batched from its own first image, or from `first_image` for the epoch a resumed run finishes;
    an epoch's last batch holds what is left of it, so it may be short, and no batch spans two epochs.

    Each epoch's order is drawn whole, one epoch ahead, and its batches are slices of it: drawing it example by
    example beside the training step, through tf.data's per-example machinery, cost several per cent of a step
    on a fast core (docs/performance.md).
    """
    def one_order(epoch):
        first = stream.first_image if epoch == stream.first_epoch else 0
        order = epoch_order(stream.num_examples, buffer_size=stream.buffer_size, seed=stream.seed, epoch=epoch)
        whole = order.take(stream.images_an_epoch).batch(stream.images_an_epoch)
        return whole.map(lambda indices: (indices, tf.constant(first, tf.int64)))

    def batches(order, first):
        starts = tf.data.Dataset.range(first, tf.shape(order, out_type=tf.int64)[0], stream.global_batch)
        return starts.map(lambda start: order[start:start + stream.global_batch])

    # One dataset per epoch, chained in Python: each shuffle's seed is then a number, not a tensor, which
    # TensorFlow's seeding cannot compare with 0 when the global seed is 0 (`--seed 0` failed to trace).
    orders = functools.reduce(tf.data.Dataset.concatenate, map(one_order, range(stream.first_epoch + 1, stream.epochs)),
                              one_order(stream.first_epoch))
    return orders.prefetch(1).flat_map(batches)


def train_indices(stream, *, pad_to=None, share=WHOLE):
    """What `fit` reads: the `stream`'s batches of example indices (`index_batches`), each `padded` up to `pad_to`
    indices when given; with `share` (index, count), only that input pipeline's part of each (`pipeline_share`).

    The tutorial's `map(scale).cache().shuffle(buffer).batch(batch)` shuffles examples through a buffer of
    `buffer_size`; here the same seeded shuffle runs over example indices, which gives the same order (tf.data's
    shuffle draws positions in its buffer, whatever the elements are). Each epoch's shuffle is seeded by its
    number, so a run resumed at any image, at any global batch, trains exactly the images an uninterrupted run
    trains from there on.
    """
    indices = index_batches(stream)
    if pad_to is not None:
        indices = indices.map(lambda batch: padded(batch, pad_to))
    if share != WHOLE:
        indices = indices.map(lambda batch: pipeline_share(batch, *share))
    # Repeated so that the stream never ends under `fit`, which stops after its epochs by itself.
    return for_distribution(indices.repeat())


def resident_copies(strategy, images, labels):
    """The split resident beside the model, never checkpointed (the model does not track it): under
    MirroredStrategy one copy on every replica's device, mirrored as the weights are (one per GPU, 47 MB of uint8
    for MNIST's training split); under MultiWorkerMirroredStrategy one copy per worker, on its first device, from
    that worker's own read, since a mirrored variable is broadcast from the chief and TensorFlow's collectives
    broadcast no uint8."""
    def resident():
        return (tf.Variable(images, trainable=False, name="resident_images"),
                tf.Variable(labels, trainable=False, name="resident_labels"))

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        with tf.device(strategy.extended.worker_devices[0]):
            return resident()
    with strategy.scope():
        return resident()


def gather_in_train_step(model, resident, *, padded):
    """Makes `model`'s train step take a batch of `train_indices` and gather and scale its examples from the
    `resident` split itself (`examples`, weighted where the batches are `padded`), on the replica's own copy. Set
    on the instance, as the model's other step hooks are, so the exported model stays the tutorial's plain
    Sequential; evaluation still reads images."""
    train_step = model.train_step

    def step_on_indices(batch):
        return train_step(examples(*resident, batch, weighted=padded))

    model.train_step = step_on_indices


def training_input(strategy, model, split, stream):
    """The run's one seam between the data and the model: returns what `fit` reads, the `stream`'s batches of
    example indices across the strategy's replicas, and makes `model`'s train step gather and scale each batch's
    examples from the training `split` (images, labels), kept resident on the replicas' devices.

    Where several replicas share a global batch (all workers' together), a batch smaller than their count is
    padded and every example carries its weight; decided here, once, for both sides."""
    replicas = strategy.num_replicas_in_sync
    pad_to = replicas if replicas > 1 else None
    gather_in_train_step(model, resident_copies(strategy, *split), padded=pad_to is not None)
    return distribute(strategy, functools.partial(train_indices, stream, pad_to=pad_to))


def step_batches(images, labels, stream, *, pad_to=None, share=WHOLE):
    """The batches each training step sees, gathered from the split on tf.data's side (`train_indices`, then
    `examples`): the same batches as the run's in-step gather, as a dataset of their own, for the tests that check
    the stream against tfds and Keras and for the benchmark of the input path."""
    indices = train_indices(stream, pad_to=pad_to, share=share)
    return indices.map(lambda batch: examples(images, labels, batch, weighted=pad_to is not None))


def eval_dataset(images, labels, *, global_batch):
    indices = tf.data.Dataset.range(int(images.shape[0])).batch(global_batch)
    return for_distribution(indices.map(lambda batch: examples(images, labels, batch, weighted=False)))


@dataclasses.dataclass(frozen=True)
class EvalInput:
    """What `evaluate` reads of the test split, and its number of steps (None: until the dataset ends)."""

    dataset: typing.Any
    steps: typing.Optional[int] = None


def eval_input(strategy, images, labels, *, global_batch):
    """The test split (images, labels) in batches of `global_batch`, for every evaluation of the run.

    A single replica reads them as it reads its training stream, through the strategy's per-replica input: Keras's
    own path would build a multi-device iterator at each evaluation and read through it, 0.1-0.3 s more of each
    (docs/performance.md). Several replicas, whose batches must be split, keep Keras's path."""
    batches = eval_dataset(images, labels, global_batch=global_batch)
    if not _single_replica(strategy):
        return EvalInput(batches)
    distributed = strategy.distribute_datasets_from_function(
        lambda context: batches.prefetch(1), _input_options(tf.distribute.InputReplicationMode.PER_REPLICA))
    return EvalInput(distributed, steps_per_epoch(int(images.shape[0]), global_batch))


def tfds_datasets(data_dir=None):
    """tfds's own per-example datasets, as the tutorial's `tfds.load('mnist', as_supervised=True)` gives them;
    for the benchmark's baseline and the tests that compare against it, not the run."""
    return tfds.load("mnist", data_dir=data_dir, as_supervised=True)


def tutorial_datasets(datasets, *, buffer_size, global_batch):
    """The tutorial's pipeline exactly as it writes it; the benchmark's baseline."""
    train = datasets["train"].map(scale).cache().shuffle(buffer_size).batch(global_batch)
    test = datasets["test"].map(scale).batch(global_batch)
    return train, test
