"""The input engine below data.py: what `fit` and `evaluate` read, made from data.py's recipe (its scale, shuffle
and batch) and a prepared tfds dataset.

A split is read from tfds's record files in vectorised batches. Where its images fit the memory limit it is held
resident, a copy beside the model on every replica's device: training then sends only each batch's example
indices through tf.data, and the train step gathers and scales its batch itself, so no batch of images crosses a
thread or a device boundary. A larger split streams: each epoch reads the record files again, shuffled and
batched by the recipe. Both orders are one: tf.data's shuffle draws positions in its buffer whatever the elements
are, so indices and examples shuffled with one seed come out in one order, and a run resumed at any image trains
the same images either way.
"""

import dataclasses
import functools
import math
import os
import typing

import tensorflow as tf

from machinery import tf_private
from machinery.exits import UsageError

READ_BATCH = 1024  # records parsed per vectorised tf.io.parse_example call
WHOLE = (0, 1)  # an input pipeline's share of each global batch: the first of one, all of it
PADDING = -1  # the index of a padding example in a batch of indices: image 0, at weight 0 (`padded`)
RESIDENT, STREAMED = "resident", "streamed"  # how a split is read (results.json's `input`)
MB = 2**20


class Recipe(typing.NamedTuple):
    """What data.py decides of the tutorial's pipeline: `scale(image, label)`, `shuffle(examples, buffer_size=,
    seed=)` and `batch(examples, global_batch)`."""

    scale: typing.Callable
    shuffle: typing.Callable
    batch: typing.Callable


@dataclasses.dataclass(frozen=True)
class Stream:
    """Which training batches a run reads, as example indices. Each epoch trains the first `epoch_images` of its
    own seeded order of the split's `num_examples` indices (all of them when None), in batches of `global_batch`;
    the stream starts at image `first_image` of epoch `first_epoch` and ends with epoch `epochs` - 1. A run takes
    its stream from its resume plan (resume.Plan.stream)."""

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


def steps_per_epoch(num_examples, global_batch, limit=None):
    steps = math.ceil(num_examples / global_batch)
    return min(steps, limit) if limit else steps


def images_per_epoch(steps, global_batch, num_examples):
    """Images one epoch of `steps` batches trains on: only an epoch's last batch can be short."""
    return min(steps * global_batch, num_examples)


# ---------------------------------------------------------------- a split, resident or streamed

@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a prepared tfds dataset (`info`): held in memory as `images` (N, height, width, channels) and
    `labels` (N,), as `tfds.load(..., as_supervised=True)` yields them, or streamed from its record files (both
    None)."""

    info: typing.Any
    name: str
    images: typing.Any = None
    labels: typing.Any = None

    @property
    def how(self):
        return STREAMED if self.images is None else RESIDENT

    @property
    def num_examples(self):
        return self.info.splits[self.name].num_examples


def split_mb(info, name):
    """The MB a split's images take in memory: examples times the image's shape times its type's bytes."""
    image = info.features["image"]
    return info.splits[name].num_examples * math.prod(image.shape) * tf.as_dtype(image.tf_dtype).size / MB


def open_split(info, name, *, limit_mb):
    """The split `name`: read into memory when its images take at most `limit_mb`, streamed otherwise."""
    if split_mb(info, name) > limit_mb:
        return Split(info, name)
    try:
        batches = list(records(info, name))
    except tf.errors.OpError as err:
        raise unreadable(info, type(err).__name__) from None
    if not batches:
        raise unreadable(info, f"no {name} examples")
    images, labels = tf.concat([b[0] for b in batches], 0), tf.concat([b[1] for b in batches], 0)
    # A record file cut short reads as a shorter one, without an error.
    if len(labels) != info.splits[name].num_examples:
        raise unreadable(info, f"{len(labels)} of {info.splits[name].num_examples} {name} examples")
    return Split(info, name, images, labels)


def records(info, name):
    """The split's examples in tfds's record order, in batches of READ_BATCH (images, labels). tfds's own reader
    parses one example at a time; parsing its record files in vectorised batches, and decoding with tfds's image
    feature in parallel, is several times faster (docs/history.md, "What was found")."""
    serialized = info.features.get_serialized_info()
    spec = {key: tf.io.FixedLenFeature(tensor.shape, tensor.tf_dtype) for key, tensor in serialized.items()}
    image = info.features["image"]

    def decode(batch):
        example = tf.io.parse_example(batch, spec)
        images = tf.map_fn(image.decode_example, example["image"],
                           fn_output_signature=tf.TensorSpec(image.shape, image.tf_dtype))
        return images, example["label"]

    files = [os.path.join(info.data_dir, file) for file in info.splits[name].filenames]
    batches = tf.data.TFRecordDataset(files).batch(READ_BATCH)
    return _untuned(batches.map(decode, num_parallel_calls=os.cpu_count() or 1))


def unreadable(info, why):
    return UsageError(f"the {info.name} dataset in {info.data_dir} cannot be read ({why}); prepare it again into an "
                      "empty dir and pass that as --data-dir")


# ---------------------------------------------------------------- tf.data and the strategy

def _untuned(dataset):
    """Turns tf.data's autotuner off: destroying an iterator waits for its tuning thread, which made `fit` return
    seconds after its last epoch (docs/history.md). These pipelines have nothing to tune."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def untune_device_pipelines():
    """Turns the autotuner off in the device-side pipelines TensorFlow's multi-device iterator builds for each
    replica, as `_untuned` does for ours: they take tf.data's default options, and destroying one waits for its
    tuning thread's next round, at the end of every `fit` and `evaluate`. Each only prefetches one batch into a
    fixed buffer. Should a later TensorFlow drop the private function this wraps, runs go on with the wait
    (tf_private.wrap_device_datasets, and its canary)."""
    tf_private.wrap_device_datasets(_untuned)


def for_distribution(dataset):
    options = tf.data.Options()
    # A split may be one file, so multi-worker sharding must split examples, not files.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return _untuned(dataset.with_options(options))


def distribute(strategy, make_dataset):
    """What `fit` is given: the training stream across the strategy's replicas, from `make_dataset(share=...)`,
    which builds the stream of one input pipeline's share of every global batch (`pipeline_share`).

    A single replica of MirroredStrategy reads the stream through the strategy's own per-replica input, one batch
    read ahead: no multi-device iterator, whose device-side pipeline stalled the end of `fit`. Under
    MultiWorkerMirroredStrategy with one replica per worker, each worker's pipeline makes only its own share of
    each global batch, split as TensorFlow's rebatching splits it (TensorFlow refuses per-replica input there and
    keeps a multi-device iterator). Several replicas in one process (GPUs, --cpu-replicas) keep Keras's path.
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
    """Input pipeline `index` of `count`'s part of a global batch (of indices, images or labels): a contiguous
    slice, sizes differing by at most one, the first pipelines taking the extra examples of a short batch. That is
    how TensorFlow's own rebatching splits a global batch between workers (a last batch of 3 gives 2 and 1; one
    of 1 would give 1 and none, but `padded` makes it 1 and a padding example), and each replica's loss is the
    mean over its own examples, so the split decides how much each example of a partial batch weighs in the
    gradient: the same split keeps the same gradients."""
    size = tf.shape(batch, out_type=tf.int64)[0]
    base, extra = size // count, size % count
    start = index * base + tf.minimum(tf.constant(index, tf.int64), extra)
    return batch[start:start + base + tf.cast(index < extra, tf.int64)]


def _missing(batch, replicas):
    return tf.maximum(tf.cast(replicas, tf.int64) - tf.shape(batch, out_type=tf.int64)[0], 0)


def padded(batch, replicas):
    """A global batch of indices with PADDING appended up to `replicas` indices, so that no replica's share is
    empty: TensorFlow 2.21's oneDNN MaxPoolGrad kernel aborts the process on an empty batch inside a graph, on
    some CPUs (docs/faults.md, "An empty replica batch"; docs/upstream/empty_batch_maxpoolgrad.py reproduces it).

    A batch is split between replicas in contiguous slices differing by at most one (`pipeline_share`), so only a
    batch of fewer examples than replicas is padded, and each of its real examples stays alone on its replica. A
    padding example weighs 0 in its replica's loss (a mean over its one example), so its gradient is exactly
    zero, as an empty replica's was: every step's update is that of its real examples."""
    return tf.concat([batch, tf.fill([_missing(batch, replicas)], tf.constant(PADDING, tf.int64))], 0)


def padded_examples(images, labels, replicas):
    """`padded` for a batch of examples: blank images appended, each with weight 0 beside the real ones' 1."""
    missing = _missing(labels, replicas)
    blank = tf.zeros(tf.concat([[missing], tf.shape(images, out_type=tf.int64)[1:]], 0), images.dtype)
    weights = tf.concat([tf.ones_like(labels, tf.float32), tf.zeros([missing], tf.float32)], 0)
    return tf.concat([images, blank], 0), tf.concat([labels, tf.zeros([missing], labels.dtype)], 0), weights


def examples(images, labels, batch, *, scale, weighted):
    """The scaled images and the labels at a batch of indices into a resident split; `weighted`, for batches
    that may hold PADDING, adds each example's weight (1, or 0 for padding), which Keras reads as sample weights."""
    if not weighted:
        return scale(tf.gather(images, batch), tf.gather(labels, batch))
    real = batch != PADDING
    batch = tf.where(real, batch, tf.zeros_like(batch))
    return (*scale(tf.gather(images, batch), tf.gather(labels, batch)), tf.cast(real, tf.float32))


# ---------------------------------------------------------------- the training stream

def epochs_of(stream, one_epoch):
    """`one_epoch(epoch, first_image)`'s datasets from the stream's first epoch to its last, chained in Python:
    each shuffle's seed is then a number, not a tensor, which TensorFlow's seeding cannot compare with 0 when the
    global seed is 0 (`--seed 0` failed to trace)."""
    later = (one_epoch(epoch, 0) for epoch in range(stream.first_epoch + 1, stream.epochs))
    return functools.reduce(tf.data.Dataset.concatenate, later, one_epoch(stream.first_epoch, stream.first_image))


def index_batches(stream, recipe):
    """The `stream`'s batches of training indices: each epoch's order is the recipe's shuffle of the split's
    indices, seeded by the epoch's number, batched from its first untrained image; an epoch's last batch holds
    what is left of it, so it may be short, and no batch spans two epochs.

    Each epoch's order is drawn whole, one epoch ahead, and its batches are slices of it: drawn example by example
    beside the training step, through tf.data's per-example machinery, it cost several per cent of a step on a
    fast core (docs/performance.md).
    """
    def one_epoch(epoch, first):
        order = recipe.shuffle(tf.data.Dataset.range(stream.num_examples), buffer_size=stream.buffer_size,
                               seed=stream.seed + epoch)
        whole = order.take(stream.images_an_epoch).batch(stream.images_an_epoch)
        return whole.map(lambda indices: (indices, tf.constant(first, tf.int64)))

    def slices(order, first):
        starts = tf.data.Dataset.range(first, tf.shape(order, out_type=tf.int64)[0], stream.global_batch)
        return starts.map(lambda start: order[start:start + stream.global_batch])

    # Prefetched across the epochs: the next epoch's order is drawn while this one's batches are read.
    return epochs_of(stream, one_epoch).prefetch(1).flat_map(slices)


def example_batches(split, stream, recipe):
    """The `stream`'s batches of a streamed split's examples, in the order `index_batches` gives its indices: each
    epoch reads the record files again, through the recipe's shuffle and batch."""
    def one_epoch(epoch, first):
        examples = recipe.shuffle(records(split.info, split.name).unbatch(), buffer_size=stream.buffer_size,
                                  seed=stream.seed + epoch)
        return recipe.batch(examples.take(stream.images_an_epoch).skip(first), stream.global_batch)

    return epochs_of(stream, one_epoch)


def train_indices(stream, recipe, *, pad_to=None, share=WHOLE):
    """What `fit` reads from a resident split: the `stream`'s batches of example indices (`index_batches`), each
    `padded` up to `pad_to` indices when given; with `share` (index, count), only that input pipeline's part of
    each (`pipeline_share`). Repeated so that the stream never ends under `fit`, which stops after its epochs."""
    indices = index_batches(stream, recipe)
    if pad_to is not None:
        indices = indices.map(lambda batch: padded(batch, pad_to))
    if share != WHOLE:
        indices = indices.map(lambda batch: pipeline_share(batch, *share))
    return for_distribution(indices.repeat())


def train_examples(split, stream, recipe, *, pad_to=None, share=WHOLE):
    """What `fit` reads from a streamed split: `train_indices`'s batches, as scaled images and labels (and
    weights, where padded)."""
    batches = example_batches(split, stream, recipe)
    if pad_to is not None:
        batches = batches.map(lambda images, labels: padded_examples(images, labels, pad_to))
    if share != WHOLE:
        batches = batches.map(lambda *batch: tuple(pipeline_share(part, *share) for part in batch))
    batches = batches.map(lambda images, labels, *weights: (*recipe.scale(images, labels), *weights))
    return for_distribution(batches.repeat())


def resident_copies(strategy, images, labels):
    """The split resident beside the model, never checkpointed (the model does not track it): under
    MirroredStrategy one copy on every replica's device, mirrored as the weights are; under
    MultiWorkerMirroredStrategy one copy per worker, on its first device, from that worker's own read, since a
    mirrored variable is broadcast from the chief and TensorFlow's collectives broadcast no uint8."""
    def resident():
        return (tf.Variable(images, trainable=False, name="resident_images"),
                tf.Variable(labels, trainable=False, name="resident_labels"))

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        with tf.device(strategy.extended.worker_devices[0]):
            return resident()
    with strategy.scope():
        return resident()


def gather_in_train_step(model, resident, recipe, *, padded):
    """Makes `model`'s train step take a batch of `train_indices` and gather and scale its examples from the
    `resident` split itself (`examples`, weighted where the batches are `padded`), on the replica's own copy. Set
    on the instance, as the model's other step hooks are, so the exported model stays a plain Sequential;
    evaluation still reads images."""
    train_step = model.train_step

    def step_on_indices(batch):
        return train_step(examples(*resident, batch, scale=recipe.scale, weighted=padded))

    model.train_step = step_on_indices


def training_input(strategy, model, split, stream, recipe):
    """The one seam between the data and the model: what `fit` reads, the `stream`'s batches across the
    strategy's replicas. A resident `split` stays on the replicas' devices, and `model`'s train step gathers and
    scales each batch of indices from it; a streamed one sends scaled batches of examples.

    Where several replicas share a global batch (all workers' together), a batch smaller than their count is
    padded and every example carries its weight; decided here, once, for both sides."""
    replicas = strategy.num_replicas_in_sync
    pad_to = replicas if replicas > 1 else None
    if split.how == STREAMED:
        return distribute(strategy, functools.partial(train_examples, split, stream, recipe, pad_to=pad_to))
    gather_in_train_step(model, resident_copies(strategy, split.images, split.labels), recipe,
                         padded=pad_to is not None)
    return distribute(strategy, functools.partial(train_indices, stream, recipe, pad_to=pad_to))


def step_batches(split, stream, recipe, *, pad_to=None, share=WHOLE):
    """The batches each training step sees, as a dataset of their own: a resident split's gathered on tf.data's
    side (`train_indices`, then `examples`), the same batches as the run's in-step gather; a streamed split's as
    `fit` reads them. For the tests that check the stream against tfds and Keras, and the input benchmark."""
    if split.how == STREAMED:
        return train_examples(split, stream, recipe, pad_to=pad_to, share=share)
    indices = train_indices(stream, recipe, pad_to=pad_to, share=share)
    return indices.map(lambda batch: examples(split.images, split.labels, batch, scale=recipe.scale,
                                              weighted=pad_to is not None))


# ---------------------------------------------------------------- the evaluations' input

@dataclasses.dataclass(frozen=True)
class EvalInput:
    """What `evaluate` reads of the test split, its number of steps (None: until the dataset ends), and how the
    split is read (RESIDENT or STREAMED)."""

    dataset: typing.Any
    steps: typing.Optional[int] = None
    how: str = RESIDENT


def eval_batches(split, recipe, *, global_batch):
    """The split in its record order, scaled, in batches of `global_batch`."""
    if split.how == STREAMED:
        batches = recipe.batch(records(split.info, split.name).unbatch(), global_batch).map(recipe.scale)
    else:
        indices = tf.data.Dataset.range(split.num_examples).batch(global_batch)
        batches = indices.map(lambda batch: examples(split.images, split.labels, batch, scale=recipe.scale,
                                                     weighted=False))
    return for_distribution(batches)


def eval_input(strategy, split, recipe, *, global_batch):
    """The test split in batches of `global_batch`, for every evaluation of the run.

    A single replica reads them as it reads its training stream, through the strategy's per-replica input: Keras's
    own path would build a multi-device iterator at each evaluation and read through it (docs/performance.md).
    Several replicas, whose batches must be split, keep Keras's path."""
    batches = eval_batches(split, recipe, global_batch=global_batch)
    if not _single_replica(strategy):
        return EvalInput(batches, how=split.how)
    distributed = strategy.distribute_datasets_from_function(
        lambda context: batches.prefetch(1), _input_options(tf.distribute.InputReplicationMode.PER_REPLICA))
    return EvalInput(distributed, steps_per_epoch(split.num_examples, global_batch), split.how)
