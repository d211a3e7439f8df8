"""The input engine below data.py: what `fit` and `evaluate` read, made from a prepared tfds dataset and data.py's
per-example functions (its `scale`, and its `augment` when it has one).

Each example goes through those functions one at a time, as `Dataset.map` calls them; the engine decides only how
the examples are held, ordered and batched:
- a split whose scaled examples fit the memory limit is read and scaled once and held in memory (the tutorial's
  `cache()`); each epoch's order is then drawn whole, as example indices, by the tutorial's seeded shuffle, and
  each batch gathered from the cache on tf.data's thread;
- a larger split streams: each epoch reads tfds's files again, scaling, shuffling and batching example by example.
Both orders are one: tf.data's shuffle draws positions in its buffer whatever the elements are, so indices and
examples shuffled with one seed come out in one order, and a run resumed at any image trains the same images
either way. An augmentation draws from a seed of each example's own (`example_seeds`), so it too is the same on
either path, at any resume and on any number of replicas.
"""

import dataclasses
import functools
import math
import os
import typing

import tensorflow as tf
import tensorflow_datasets as tfds

from machinery.exits import UsageError
from machinery.tfds_builders import IMAGE, LABEL  # the features the run trains on

READ_BATCH = 1024  # examples read, decoded and scaled together
WHOLE = (0, 1)  # an input pipeline's share of each global batch: the first of one, all of it
PADDING = -1  # the index of a padding example in a batch of indices: example 0, at weight 0 (`padded`)
RESIDENT, STREAMED = "resident", "streamed"  # how a split is read (results.json's `input`)
MB = 2**20


@dataclasses.dataclass(frozen=True)
class Stream:
    """Which training batches a run reads. Each epoch trains the first `epoch_images` of its own seeded order of
    the split's `num_examples` examples (all of them when None), in batches of `global_batch`; the stream starts
    at image `first_image` of epoch `first_epoch` and ends with epoch `epochs` - 1. A run takes its stream from its
    resume plan (resume.Plan.stream)."""

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


# ---------------------------------------------------------------- tfds's examples, scaled

def _one_example(spec):
    """The spec of one example of a dataset of batches."""
    return tf.nest.map_structure(lambda batch: tf.TensorSpec(batch.shape[1:], batch.dtype), spec)


def _decoded_in_batches(info):
    """Whether tfds stores the split's images in one shape, in record files a batch of which can be parsed and
    decoded at once; tfds's own reader parses and decodes one example at a time, several times slower
    (docs/performance.md, "Reading the splits")."""
    return info.features[IMAGE].shape.count(None) == 0 and info.file_format == tfds.core.FileFormat.TFRECORD


def scaled_batches(info, name, scale):
    """The split `name` in tfds's record order, each example (image, label) through `scale`, in batches of
    READ_BATCH. Images of one shape are parsed and decoded a batch at a time with tfds's own features, and `scale`
    is vectorised over the batch (tf.vectorized_map, under which it still sees one example); images of varying
    size come from tfds's own reader, one example at a time, each mapped through `scale`."""
    image = info.features[IMAGE]
    if not _decoded_in_batches(info):
        examples = tfds.builder_from_directory(info.data_dir).as_dataset(name, shuffle_files=False)
        examples = examples.map(lambda example: (example[IMAGE], example[LABEL]))
        return _untuned(examples.map(scale, num_parallel_calls=os.cpu_count() or 1).batch(READ_BATCH))
    serialized = info.features.get_serialized_info()
    spec = {key: tf.io.FixedLenFeature(serialized[key].shape, serialized[key].tf_dtype) for key in (IMAGE, LABEL)}

    def decoded_and_scaled(records):
        example = tf.io.parse_example(records, spec)
        # tfds's own decode_batch_example reads the deprecated FeatureConnector.dtype, whose warning would break a
        # refusal's one line on stderr; a ClassLabel's serialized value is the label itself.
        images = tf.map_fn(image.decode_example, example[IMAGE],
                           fn_output_signature=tf.TensorSpec(image.shape, image.tf_dtype))
        return tf.vectorized_map(lambda one: scale(*one), (images, example[LABEL]))

    files = [os.path.join(info.data_dir, file) for file in info.splits[name].filenames]
    records = tf.data.TFRecordDataset(files).batch(READ_BATCH)
    return _untuned(records.map(decoded_and_scaled, num_parallel_calls=os.cpu_count() or 1))


# ---------------------------------------------------------------- a split, cached or streamed

@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a prepared tfds dataset (`info`), its `num_examples` examples through `scale`: `cache` holds
    them all in memory, a (features, label) pair of variables of N examples each (`held`), or is None for a split
    streamed from its files. `element_spec` is one scaled example's, what the model is built for."""

    info: typing.Any
    name: str
    scale: typing.Callable
    element_spec: typing.Any
    num_examples: int
    cache: typing.Any = None

    @property
    def how(self):
        return STREAMED if self.cache is None else RESIDENT

    def examples(self):
        """The split's scaled examples one by one, in record order, read from its files."""
        return scaled_batches(self.info, self.name, self.scale).unbatch()


def cache_mb(element_spec, num_examples):
    """The MB `num_examples` examples of `element_spec` take in memory."""
    return num_examples * sum(spec.shape.num_elements() * spec.dtype.size
                              for spec in tf.nest.flatten(element_spec)) / MB


def refuse_varying_sizes(info, element_spec):
    """UsageError when the scaled examples' shapes vary: they can be neither batched nor cached."""
    varying = [tuple(spec.shape) for spec in tf.nest.flatten(element_spec) if not spec.shape.is_fully_defined()]
    if varying:
        raise UsageError(f"the {info.name} images vary in size (tfds stores them as {info.features[IMAGE].shape}, "
                         f"data.scale returns {', '.join(map(str, varying))}); resize them to one size in data.scale, "
                         "e.g. image = tf.image.resize(image, (64, 64))")


def open_split(info, name, scale, *, limit_mb):
    """The split `name`, scaled: cached in memory when its scaled examples take at most `limit_mb`, else streamed."""
    batches = scaled_batches(info, name, scale)
    element_spec = _one_example(batches.element_spec)
    refuse_varying_sizes(info, element_spec)
    num_examples = info.splits[name].num_examples
    if cache_mb(element_spec, num_examples) > limit_mb:
        return Split(info, name, scale, element_spec, num_examples)
    try:
        read = list(batches)
    except tf.errors.OpError as err:
        raise unreadable(info, type(err).__name__) from None
    if not read:
        raise unreadable(info, f"no {name} examples")
    cache = tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *read)
    # A record file cut short reads as a shorter one, without an error.
    read_count = len(tf.nest.flatten(cache)[0])
    if read_count != num_examples:
        raise unreadable(info, f"{read_count} of {num_examples} {name} examples")
    return Split(info, name, scale, element_spec, num_examples, held(cache))


def held(cache):
    """The cache in variables on the host's CPU, where tf.data's functions run, which capture a variable by its
    handle: a captured tensor is copied into every iterator made over it, at each `fit` and `evaluate`. The model
    does not track them, so no checkpoint holds them."""
    with tf.device("/cpu:0"):
        return tf.nest.map_structure(lambda tensor: tf.Variable(tensor, trainable=False), cache)


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
    from machinery import tf_private

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
    """Input pipeline `index` of `count`'s part of a global batch (of indices or of examples' tensors): a
    contiguous slice, sizes differing by at most one, the first pipelines taking the extra examples of a short
    batch. That is how TensorFlow's own rebatching splits a global batch between workers (a last batch of 3 gives
    2 and 1; one of 1 would give 1 and none, but `padded` makes it 1 and a padding example), and each replica's
    loss is the mean over its own examples, so the split decides how much each example of a partial batch weighs
    in the gradient: the same split keeps the same gradients."""
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


def padded_examples(batch, replicas):
    """`padded` for a batch of examples (features, label): zeros appended to each tensor, and each example's weight,
    0 for those beside the real ones' 1."""
    label = batch[1]
    missing = _missing(tf.nest.flatten(label)[0], replicas)

    def pad(tensor):
        blank = tf.zeros(tf.concat([[missing], tf.shape(tensor, out_type=tf.int64)[1:]], 0), tensor.dtype)
        return tf.concat([tensor, blank], 0)

    real = tf.ones(tf.shape(tf.nest.flatten(label)[0])[:1], tf.float32)
    return (*tf.nest.map_structure(pad, batch), tf.concat([real, tf.zeros([missing], tf.float32)], 0))


# ---------------------------------------------------------------- the training stream

def shuffled(examples, stream, epoch):
    """The tutorial's `shuffle(BUFFER_SIZE)`, seeded: each epoch's order has a seed of its own (the run's seed plus
    the epoch's number), so that every run, resumed or not, sees the same order."""
    return examples.shuffle(stream.buffer_size, seed=stream.seed + epoch, reshuffle_each_iteration=False)


def example_seeds(stream, epoch, indices):
    """Each example's seed for an augmentation's stateless random ops, one pair of int64 per index: the run's seed,
    and the example's draw (the epoch times the split's examples, plus its index). Every epoch draws anew, and an
    example draws the same on either input path, in any batch, at any resume."""
    draws = tf.cast(epoch, tf.int64) * stream.num_examples + tf.cast(indices, tf.int64)
    return tf.stack([tf.fill(tf.shape(draws), tf.constant(stream.seed, tf.int64)), draws], axis=1)


def augmented(batch, seeds, augment):
    """`augment(features, label, seed)` on each example of a batch, one at a time as `Dataset.map` calls it; the
    batch stays one batch."""
    features, label = batch
    examples = tf.data.Dataset.from_tensor_slices((features, label, seeds)).map(augment)
    return examples.batch(tf.shape(seeds, out_type=tf.int64)[0]).get_single_element()


def epochs_of(stream, one_epoch):
    """`one_epoch(epoch, first_image)`'s datasets from the stream's first epoch to its last, chained in Python:
    each shuffle's seed is then a number, not a tensor, which TensorFlow's seeding cannot compare with 0 when the
    global seed is 0 (`--seed 0` failed to trace)."""
    later = (one_epoch(epoch, 0) for epoch in range(stream.first_epoch + 1, stream.epochs))
    return functools.reduce(tf.data.Dataset.concatenate, later, one_epoch(stream.first_epoch, stream.first_image))


def index_batches(stream):
    """The `stream`'s batches of training indices, each with its epoch: each epoch's order is the seeded shuffle of
    the split's indices, batched from its first untrained image; an epoch's last batch holds what is left of it,
    so it may be short, and no batch spans two epochs.

    Each epoch's order is drawn whole, one epoch ahead, and its batches are slices of it: drawn example by example
    beside the training step, through tf.data's per-example machinery, it cost several per cent of a step on a
    fast core (docs/performance.md).
    """
    def one_epoch(epoch, first):
        order = shuffled(tf.data.Dataset.range(stream.num_examples), stream, epoch)
        whole = order.take(stream.images_an_epoch).batch(stream.images_an_epoch)
        return whole.map(lambda indices: (indices, tf.constant(first, tf.int64), tf.constant(epoch, tf.int64)))

    def slices(order, first, epoch):
        starts = tf.data.Dataset.range(first, tf.shape(order, out_type=tf.int64)[0], stream.global_batch)
        return starts.map(lambda start: (order[start:start + stream.global_batch], epoch))

    # Prefetched across the epochs: the next epoch's order is drawn while this one's batches are read.
    return epochs_of(stream, one_epoch).prefetch(1).flat_map(slices)


def cached_at(split, indices):
    """The cached split's examples at `indices`, (features, label)."""
    return tf.nest.map_structure(lambda cached: tf.gather(cached, indices), split.cache)


def gathered(split, stream, indices, epoch, *, augment=None, weighted=False):
    """The cached examples at a batch of `indices` (PADDING reads example 0), each through `augment` when given;
    `weighted`, for batches that may hold PADDING, adds each example's weight (1, or 0 for padding), which Keras
    reads as sample weights."""
    real = indices != PADDING
    at = tf.where(real, indices, tf.zeros_like(indices))
    batch = cached_at(split, at)
    if augment is not None:
        batch = augmented(batch, example_seeds(stream, epoch, at), augment)
    return (*batch, tf.cast(real, tf.float32)) if weighted else tuple(batch)


def cached_batches(split, stream, *, augment=None, pad_to=None, share=WHOLE):
    """The `stream`'s batches of a cached split: `index_batches`, each `padded` up to `pad_to` indices when given,
    cut to the input pipeline `share` (index, count) of it (`pipeline_share`), gathered and augmented."""
    indices = index_batches(stream)
    if pad_to is not None:
        indices = indices.map(lambda batch, epoch: (padded(batch, pad_to), epoch))
    if share != WHOLE:
        indices = indices.map(lambda batch, epoch: (pipeline_share(batch, *share), epoch))
    return indices.map(lambda batch, epoch: gathered(split, stream, batch, epoch, augment=augment,
                                                     weighted=pad_to is not None))


def streamed_batches(split, stream, *, augment=None, pad_to=None, share=WHOLE):
    """The `stream`'s batches of a streamed split, in the order `index_batches` gives a cached one's: each epoch
    reads the files again, each example with its index through the seeded shuffle, `augment` and the batch."""
    def one_epoch(epoch, first):
        examples = shuffled(split.examples().enumerate(), stream, epoch).take(stream.images_an_epoch).skip(first)
        if augment is not None:
            examples = examples.map(lambda index, example: (index, augment(
                *example, example_seeds(stream, epoch, index[None])[0])))
        return examples.map(lambda index, example: example).batch(stream.global_batch)

    batches = epochs_of(stream, one_epoch)
    if pad_to is not None:
        batches = batches.map(lambda *batch: padded_examples(batch, pad_to))
    if share != WHOLE:
        batches = batches.map(lambda *batch: tf.nest.map_structure(lambda part: pipeline_share(part, *share), batch))
    return batches


def train_batches(split, stream, *, augment=None, pad_to=None, share=WHOLE):
    """What `fit` reads of the training split: the `stream`'s batches of (features, label), and each example's
    weight where the batches are padded to `pad_to` examples, cut to the pipeline `share`. Repeated, so that the
    stream never ends under `fit`, which stops after its epochs."""
    batches = cached_batches if split.how == RESIDENT else streamed_batches
    return for_distribution(batches(split, stream, augment=augment, pad_to=pad_to, share=share).repeat())


def training_input(strategy, split, stream, *, augment=None):
    """What `fit` reads: the `stream`'s batches across the strategy's replicas. Where several replicas share a
    global batch (all workers' together), a batch smaller than their count is padded and every example carries
    its weight."""
    replicas = strategy.num_replicas_in_sync
    pad_to = replicas if replicas > 1 else None
    return distribute(strategy, functools.partial(train_batches, split, stream, augment=augment, pad_to=pad_to))


# ---------------------------------------------------------------- the evaluations' input

@dataclasses.dataclass(frozen=True)
class EvalInput:
    """What `evaluate` reads of the test split, its number of steps (None: until the dataset ends), and how the
    split is read (RESIDENT or STREAMED)."""

    dataset: typing.Any
    steps: typing.Optional[int] = None
    how: str = RESIDENT


def eval_batches(split, *, global_batch):
    """The split in its record order, scaled, in batches of `global_batch`."""
    if split.how == STREAMED:
        batches = split.examples().batch(global_batch)
    else:
        indices = tf.data.Dataset.range(split.num_examples).batch(global_batch)
        batches = indices.map(lambda at: tuple(cached_at(split, at)))
    return for_distribution(batches)


def eval_input(strategy, split, *, global_batch):
    """The test split in batches of `global_batch`, for every evaluation of the run.

    A single replica reads them as it reads its training stream, through the strategy's per-replica input: Keras's
    own path would build a multi-device iterator at each evaluation and read through it (docs/performance.md).
    Several replicas, whose batches must be split, keep Keras's path."""
    batches = eval_batches(split, global_batch=global_batch)
    if not _single_replica(strategy):
        return EvalInput(batches, how=split.how)
    distributed = strategy.distribute_datasets_from_function(
        lambda context: batches.prefetch(1), _input_options(tf.distribute.InputReplicationMode.PER_REPLICA))
    return EvalInput(distributed, steps_per_epoch(split.num_examples, global_batch), split.how)
