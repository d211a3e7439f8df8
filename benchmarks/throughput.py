"""Training throughput: the tutorial's pipeline as it writes it against the project's, side by side.

    python benchmarks/throughput.py --idx-dir ../shared/datasets/mnist      # or --data-dir DIR (prepared)

Rounds alternate A B A B ..., each a fresh model trained `--epochs` full epochs (the first includes the
input cache fill and tracing, as in a real run). Also measured: a compute-only ceiling, the same train step
looping over batches already resident in memory inside one tf.function, with no input pipeline and no
per-step Python. Figures are printed and written to `--output` (JSON).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

import callbacks  # noqa: E402
import data  # noqa: E402
from config import Config, UsageError  # noqa: E402
from model import build_model, compile_model, keras  # noqa: E402

# Each variant is the project's pipeline with these Config fields changed; "project" is the default run.
VARIANTS = {
    "project": {},
    "no_steps_per_execution": {"steps_per_execution": 1},
    "no_prefetch": {"prefetch": False},
    "jit_compile": {"jit_compile": True},
}


def _images(steps, global_batch, num_train, epochs):
    return epochs * min(steps * global_batch, num_train)


def tutorial_round(datasets, info, cfg, strategy, epochs, work_dir):
    """The tutorial's code: its pipeline, its compile, `fit` with its four callbacks."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    train, _ = data.tutorial_datasets(datasets, buffer_size=cfg.buffer_size, global_batch=global_batch)
    with strategy.scope():
        model = compile_model(build_model())
    schedule = keras.callbacks.LearningRateScheduler(lambda e: callbacks.decay(e, cfg.lr_boundaries, cfg.lr_values))
    cbs = [keras.callbacks.TensorBoard(log_dir=os.path.join(work_dir, "logs")),
           keras.callbacks.ModelCheckpoint(os.path.join(work_dir, "ckpt_{epoch}"), save_weights_only=True),
           schedule, callbacks.PrintLR()]
    start = time.perf_counter()
    model.fit(train, epochs=epochs, callbacks=cbs, verbose=0)
    seconds = time.perf_counter() - start
    num_train = info.splits["train"].num_examples
    return num_train * epochs / seconds


def project_round(datasets, info, cfg, strategy, epochs, work_dir):
    """The project's default run's pipeline, compile and callbacks (the ones `train_mnist_mirrored` uses)."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    num_train = info.splits["train"].num_examples
    steps = data.steps_per_epoch(num_train, global_batch)
    train = data.train_dataset(datasets["train"], buffer_size=cfg.buffer_size, global_batch=global_batch,
                               seed=cfg.seed, first_epoch=0, epochs=epochs, steps=steps, prefetch=cfg.prefetch)
    with strategy.scope():
        model = compile_model(build_model(), steps_per_execution=cfg.steps_per_execution, jit_compile=cfg.jit_compile)
    cbs = callbacks.make_callbacks(cfg, log_dir=os.path.join(work_dir, "logs"),
                                   checkpoint_dir=os.path.join(work_dir, "ckpt"), backup_dir=os.path.join(work_dir, "backup"))
    start = time.perf_counter()
    model.fit(train, epochs=epochs, steps_per_epoch=steps, callbacks=cbs, verbose=0)
    seconds = time.perf_counter() - start
    return _images(steps, global_batch, num_train, epochs) / seconds


def compute_ceiling(datasets, info, cfg, strategy, epochs):
    """The train step alone: every batch already in memory, one tf.function looping over them."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    num_train = info.splits["train"].num_examples
    full = num_train // global_batch
    images, labels = next(iter(datasets["train"].map(data.scale).batch(full * global_batch)))
    images = tf.reshape(images, (full, global_batch, 28, 28, 1))
    labels = tf.reshape(labels, (full, global_batch))
    with strategy.scope():
        model = compile_model(build_model())
        model.build((None, 28, 28, 1))
        model.optimizer.build(model.trainable_variables)

    @tf.function
    def train_epoch():
        for i in tf.range(full):
            strategy.run(model.train_step, args=((images[i], labels[i]),))

    train_epoch()  # trace and warm up outside the timing
    start = time.perf_counter()
    for _ in range(epochs):
        train_epoch()
    seconds = time.perf_counter() - start
    return full * global_batch * epochs / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--idx-dir", help="folder with the four MNIST IDX files (prepared into a temporary tfds dir)")
    source.add_argument("--data-dir", help="a prepared tfds data dir")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (at least 2 for a fair comparison)")
    parser.add_argument("--epochs", type=int, default=1, help="full epochs per round")
    parser.add_argument("--variants", default="project", help=f"comma-separated, from: {','.join(VARIANTS)}")
    parser.add_argument("--output", default="benchmarks/throughput.json", help="JSON file for the figures")
    args = parser.parse_args(argv)
    try:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise UsageError(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
        if args.rounds < 1 or args.epochs < 1:
            raise UsageError("--rounds and --epochs must be at least 1")
        work = tempfile.TemporaryDirectory(prefix="mnist-bench-")
        data_dir = args.data_dir
        if args.idx_dir:
            data_dir = os.path.join(work.name, "tfds")
            data.prepare(args.idx_dir, data_dir)
        datasets, info = data.load(data_dir)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    cfg = Config()
    keras.utils.set_random_seed(cfg.seed)
    strategy = tf.distribute.MirroredStrategy()
    names = ["tutorial"] + args.variants.split(",")
    figures = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            round_dir = tempfile.mkdtemp(dir=work.name)
            if name == "tutorial":
                rate = tutorial_round(datasets, info, cfg, strategy, args.epochs, round_dir)
            else:
                variant = dataclasses.replace(cfg, **VARIANTS[name])
                rate = project_round(datasets, info, variant, strategy, args.epochs, round_dir)
            figures[name].append(rate)
            print(f"round {round_ + 1}  {name:<24} {rate:10.0f} images/s", flush=True)
    ceiling = compute_ceiling(datasets, info, cfg, strategy, args.epochs)

    baseline = statistics.median(figures["tutorial"])
    results = {
        "replicas": strategy.num_replicas_in_sync,
        "epochs_per_round": args.epochs,
        "rounds": args.rounds,
        "images_per_s": {name: [round(r, 1) for r in rates] for name, rates in figures.items()},
        "median_images_per_s": {name: round(statistics.median(rates), 1) for name, rates in figures.items()},
        "ratio_to_tutorial": {name: round(statistics.median(rates) / baseline, 3) for name, rates in figures.items()},
        "compute_ceiling_images_per_s": round(ceiling, 1),
    }
    print(f"\n{'pipeline':<24} {'median images/s':>16} {'x tutorial':>11}")
    for name in names:
        print(f"{name:<24} {results['median_images_per_s'][name]:>16.0f} {results['ratio_to_tutorial'][name]:>11.2f}")
    print(f"{'compute ceiling':<24} {ceiling:>16.0f} {ceiling / baseline:>11.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"figures written to {args.output}")
    work.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
