"""Training throughput: the tutorial's pipeline as it writes it against the project's, side by side.

    python benchmarks/throughput.py --idx-dir ../shared/datasets/mnist      # or --data-dir DIR (prepared)

Rounds alternate A B A B ..., each in a fresh process (as a real run is), a fresh model trained `--epochs`
full epochs; the first epoch includes the input cache fill and tracing, as in a real run. A round's time is
the wall time of `fit`. Also measured: a compute-only ceiling, the same train step
looping over batches already resident in memory inside one tf.function, with no input pipeline and no
per-step Python. Figures are printed and written to `--output` (JSON).
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
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

RESULT_MARK = "BENCH images/s "

# Each variant is the project's default run with one change undone, or (prefetch, jit_compile) one more tried.
VARIANTS = {
    "project": {},
    "keras_adam": {"fused_adam": False},
    "steps_per_execution_1": {"steps_per_execution": 1},
    "prefetch": {"prefetch": True},
    "jit_compile": {"jit_compile": True},
}


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
        model = compile_model(build_model(), steps_per_execution=cfg.steps_per_execution,
                              jit_compile=cfg.jit_compile, fused_adam=cfg.fused_adam)
    cbs = callbacks.make_callbacks(cfg, log_dir=os.path.join(work_dir, "logs"),
                                   checkpoint_dir=os.path.join(work_dir, "ckpt"), backup_dir=os.path.join(work_dir, "backup"))
    start = time.perf_counter()
    model.fit(train, epochs=epochs, steps_per_epoch=steps, callbacks=cbs, verbose=0)
    seconds = time.perf_counter() - start
    return epochs * data.images_per_epoch(steps, global_batch, num_train) / seconds


def compute_ceiling(datasets, info, cfg, strategy, epochs):
    """The train step alone: every batch already in memory, one tf.function looping over them."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    num_train = info.splits["train"].num_examples
    full = num_train // global_batch
    images, labels = next(iter(datasets["train"].map(data.scale).batch(full * global_batch)))
    images = tf.reshape(images, (full, global_batch, 28, 28, 1))
    labels = tf.reshape(labels, (full, global_batch))
    with strategy.scope():
        model = compile_model(build_model(), fused_adam=cfg.fused_adam)
        model.build((None, 28, 28, 1))

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


def measure_one(name, data_dir, epochs):
    """One round, in this process: a fresh process per round keeps rounds from slowing each other."""
    datasets, info = data.load(data_dir)
    cfg = Config()
    keras.utils.set_random_seed(cfg.seed)
    strategy = tf.distribute.MirroredStrategy()
    with tempfile.TemporaryDirectory(prefix="mnist-bench-round-") as work_dir:
        if name == "tutorial":
            return tutorial_round(datasets, info, cfg, strategy, epochs, work_dir)
        if name == "ceiling":
            return compute_ceiling(datasets, info, cfg, strategy, epochs)
        return project_round(datasets, info, dataclasses.replace(cfg, **VARIANTS[name]), strategy, epochs, work_dir)


def run_one(name, data_dir, epochs):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--data-dir", data_dir, "--epochs", str(epochs),
                           "--one", name], capture_output=True, text=True)
    marks = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not marks:
        raise RuntimeError(f"the {name} round failed:\n{proc.stderr[-3000:]}")
    return float(marks[-1][len(RESULT_MARK):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--idx-dir", help="folder with the four MNIST IDX files (prepared into a temporary tfds dir)")
    source.add_argument("--data-dir", help="a prepared tfds data dir")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (at least 2 for a fair comparison)")
    parser.add_argument("--epochs", type=int, default=Config().epochs, help="full epochs per round (default: the default run's)")
    parser.add_argument("--variants", default="project", help=f"comma-separated, from: {','.join(VARIANTS)}")
    parser.add_argument("--output", default="benchmarks/throughput.json", help="JSON file for the figures")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one round in this process
    args = parser.parse_args(argv)
    if args.one:
        print(f"{RESULT_MARK}{measure_one(args.one, args.data_dir, args.epochs)}")
        return 0
    try:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise UsageError(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
        if args.rounds < 1 or args.epochs < 1:
            raise UsageError("--rounds and --epochs must be at least 1")
        work = tempfile.TemporaryDirectory(prefix="mnist-bench-")
        data_dir = os.path.join(work.name, "tfds") if args.idx_dir else args.data_dir
        data.load(data_dir, args.idx_dir)  # checks the data (and prepares it from --idx-dir) once, up front
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    names = ["tutorial"] + args.variants.split(",")
    figures = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            figures[name].append(run_one(name, data_dir, args.epochs))
            print(f"round {round_ + 1}  {name:<24} {figures[name][-1]:10.0f} images/s", flush=True)
    ceiling = run_one("ceiling", data_dir, args.epochs)

    baseline = statistics.median(figures["tutorial"])
    results = {
        "replicas": 1,
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
