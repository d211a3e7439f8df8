"""Training throughput: the tutorial's pipeline as it writes it against the project's, side by side.

    python benchmarks/throughput.py --idx-dir ../shared/datasets/mnist      # or --data-dir DIR (prepared)

Rounds alternate A B A B ..., each in a fresh process (as a real run is), a fresh model trained `--epochs`
full epochs; the first epoch includes the input cache fill and tracing, as in a real run. A round's time is
the wall time of `fit`. Also measured: a compute-only ceiling, the same train step
looping over batches already resident in memory inside one tf.function, with no input pipeline and no
per-step Python. Figures are printed and written to `--output` (JSON).

Wall time suffers when the machine is shared: a virtual machine's host may run other guests on its cores
(steal time; 19 % of this project's 2-core machine during one run). So each round also reports images per
CPU-second of its own process (all threads), which stolen time does not count, and the round's steal share.
"""

import argparse
import dataclasses
import json
import os
import platform
import resource
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

RESULT_MARK = "BENCH "
PROC_STAT = "/proc/stat"  # Linux's CPU time counters; the 8th is time stolen by the hypervisor
PROC_CPUINFO = "/proc/cpuinfo"
STEAL_COLUMN = 7
# Wall-time ratio (what a user waits for) and CPU-time ratio (what stolen time does not blur).
RATIO_KEYS = {"images_per_s": "ratio_to_tutorial", "images_per_cpu_s": "cpu_ratio_to_tutorial"}

# Each variant is the project's default run with one change undone, or (prefetch, jit_compile) one more tried.
VARIANTS = {
    "project": {},
    "keras_adam": {"fused_adam": False},
    "steps_per_execution_1": {"steps_per_execution": 1},
    "prefetch": {"prefetch": True},
    "jit_compile": {"jit_compile": True},
}


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _timed(work):
    """(wall seconds, CPU seconds of this process) that `work()` took."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    work()
    return time.perf_counter() - wall, _cpu_seconds() - cpu


def _cpu_ticks():
    """(stolen, total) CPU ticks of the whole machine so far, or None where the kernel does not say."""
    try:
        with open(PROC_STAT) as f:
            ticks = [int(field) for field in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[STEAL_COLUMN], sum(ticks)) if len(ticks) > STEAL_COLUMN else None


def _cpu_model():
    try:
        with open(PROC_CPUINFO) as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


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
    times = _timed(lambda: model.fit(train, epochs=epochs, callbacks=cbs, verbose=0))
    return info.splits["train"].num_examples * epochs, times


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
    times = _timed(lambda: model.fit(train, epochs=epochs, steps_per_epoch=steps, callbacks=cbs, verbose=0))
    return epochs * data.images_per_epoch(steps, global_batch, num_train), times


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
    times = _timed(lambda: [train_epoch() for _ in range(epochs)])
    return full * global_batch * epochs, times


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
    """Runs one round in a fresh process; its figures plus the machine's steal share while it ran."""
    before = _cpu_ticks()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--data-dir", data_dir, "--epochs", str(epochs),
                           "--one", name], capture_output=True, text=True)
    marks = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not marks:
        raise RuntimeError(f"the {name} round failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(marks[-1][len(RESULT_MARK):])
    after = _cpu_ticks()
    stolen = None
    if before and after and after[1] > before[1]:
        stolen = round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)
    return {**figures, "steal_percent": stolen}


def _describe(figures):
    steal = "" if figures["steal_percent"] is None else f"   steal {figures['steal_percent']:4.1f} %"
    return f"{figures['images_per_s']:8.0f} images/s {figures['images_per_cpu_s']:8.0f} images/CPU-s{steal}"


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
        images, (wall, cpu) = measure_one(args.one, args.data_dir, args.epochs)
        print(RESULT_MARK + json.dumps({"images_per_s": images / wall, "images_per_cpu_s": images / cpu}))
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
    rounds = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            rounds[name].append(run_one(name, data_dir, args.epochs))
            print(f"round {round_ + 1}  {name:<24} {_describe(rounds[name][-1])}", flush=True)
    ceiling = run_one("ceiling", data_dir, args.epochs)
    print(f"ceiling  {'train step alone':<24} {_describe(ceiling)}", flush=True)

    results = {"cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(), "replicas": 1,
               "epochs_per_round": args.epochs, "rounds": args.rounds}
    table = {name: [] for name in names + ["ceiling"]}  # per row: (median, x tutorial) for each key
    for key in ("images_per_s", "images_per_cpu_s"):
        rates = {name: [r[key] for r in measured] for name, measured in rounds.items()}
        medians = {name: statistics.median(values) for name, values in rates.items()}
        ratios = {name: m / medians["tutorial"] for name, m in medians.items()}
        results[key] = {name: [round(v, 1) for v in values] for name, values in rates.items()}
        results[f"median_{key}"] = {name: round(m, 1) for name, m in medians.items()}
        results[RATIO_KEYS[key]] = {name: round(r, 3) for name, r in ratios.items()}
        results[f"compute_ceiling_{key}"] = round(ceiling[key], 1)
        for name in names:
            table[name].append((medians[name], ratios[name]))
        table["ceiling"].append((ceiling[key], ceiling[key] / medians["tutorial"]))
    results["steal_percent"] = {name: [r["steal_percent"] for r in measured] for name, measured in rounds.items()}

    print(f"\n{'pipeline':<24} {'images/s':>10} {'x tutorial':>11} {'images/CPU-s':>13} {'x tutorial':>11}")
    for name, ((wall, wall_ratio), (cpu, cpu_ratio)) in table.items():
        print(f"{name:<24} {wall:>10.0f} {wall_ratio:>11.2f} {cpu:>13.0f} {cpu_ratio:>11.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"figures written to {args.output}")
    work.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
