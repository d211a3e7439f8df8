"""Training throughput of the project's default run against the model's own compute ceiling.

    python benchmarks/throughput.py --idx-dir ../shared/datasets/mnist      # or --data-dir DIR (prepared)
    python benchmarks/throughput.py --data-dir DIR --quick                  # 3 epochs, 2 rounds
    python benchmarks/throughput.py --idx-dir DIR --variants project,bfloat16 --rounds 3   # float32 and bfloat16

Each round runs, each in a fresh process (as a real run is): the tutorial's code exactly as it writes it, the
project's default run (`train_mnist_mirrored.py` itself, into a temporary --output-dir, its figures read from
its results.json), any `--variants` (the same command with other options), and the compute ceiling. A round of
a pipeline trains a fresh model `--epochs` full epochs with `fit`; its time is the wall time of `fit`, first
epoch, tracing and callbacks included. The ceiling is the same train step looping inside one tf.function over
batches already in memory: no input pipeline, no callbacks, no per-step Python, tracing excluded. The headline
is the project's median over rounds divided by the ceiling's median; each variant is also set against the project
(`--variants project,bfloat16`: bfloat16 against float32), in both rates and in test accuracy (the restored
checkpoint's, from results.json). Beside it, with two epochs or more, each
pipeline's rate over its epochs after the first against the ceiling's, and its fixed cost: the seconds a round
spends beyond its epochs at that rate (tracing, the first execution, the end of `fit`), which decide a short
round on a fast core.

Wall time suffers when the machine is shared: a virtual machine's host may run other guests on its cores
(steal time). So each round also reports images per CPU-second of its own process (all threads), which stolen
time does not count, and the round's steal share.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train_mnist_mirrored  # noqa: E402,F401  (first: it sets TensorFlow's environment as every run has it)
import tensorflow as tf  # noqa: E402

import callbacks  # noqa: E402
import data  # noqa: E402
from config import Config  # noqa: E402
from machinery import outputs, terminal  # noqa: E402
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, UsageError  # noqa: E402
from model import build_model, compile_model, keras  # noqa: E402

RESULT_MARK = "BENCH "
PROC_STAT = "/proc/stat"  # Linux's CPU time counters; the 8th is time stolen by the hypervisor
PROC_CPUINFO = "/proc/cpuinfo"
STEAL_COLUMN = 7
QUICK = {"epochs": 3, "rounds": 2}
RATES = ("images_per_s", "images_per_cpu_s")  # wall time (what a user waits for), CPU time (what steal does not blur)
BASELINES = ("ceiling", "tutorial", "project")

ENTRYPOINT = os.path.join(ROOT, "train_mnist_mirrored.py")
# Each variant is the project's default run with other options: one speed default undone, or one more tried.
VARIANTS = {
    "project": [],
    "steps_per_execution_1": ["--steps-per-execution", "1"],
    "keras_adam": ["--no-fused-adam"],
    "jit_compile": ["--jit-compile"],
    "strategy_default": ["--strategy", "default"],
    # Keras's mixed_bfloat16 policy: faster where the CPU computes bfloat16 (AVX512_BF16, AMX), slower elsewhere.
    "bfloat16": ["--mixed-precision", "bfloat16"],
    # Both splits streamed from tfds's files every epoch, as a split larger than --resident-limit-mb is.
    "streamed": ["--resident-limit-mb", "0"],
}
BASELINE = "baseline"  # --baseline DIR: that checkout's default run, in the same rounds


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def timed(work):
    """(result, wall seconds, CPU seconds of this process) of `work()`."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = work()
    return result, time.perf_counter() - wall, _cpu_seconds() - cpu


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


# ---------------------------------------------------------------- one round of each pipeline

def _timed_fit(model, train, cbs, **fit_args):
    """(wall seconds, CPU seconds, each epoch's seconds) of `model.fit`."""
    clock = callbacks.EpochClock()
    _, wall, cpu = timed(lambda: model.fit(train, callbacks=[*cbs, clock], **fit_args))
    return wall, cpu, clock.epoch_seconds()


def tutorial_round(data_dir, info, cfg, strategy, epochs, work_dir):
    """The tutorial's code: its pipeline, its compile, `fit` with its four callbacks."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    train, _ = data.tutorial_datasets(cfg.dataset, data_dir, buffer_size=cfg.buffer_size, global_batch=global_batch)
    with strategy.scope():
        model = compile_model(build_model(*data.image_shape_and_classes(info)))
    schedule = keras.callbacks.LearningRateScheduler(lambda e: callbacks.decay(e, cfg.lr_boundaries, cfg.lr_values))
    cbs = [keras.callbacks.TensorBoard(log_dir=os.path.join(work_dir, "logs")),
           keras.callbacks.ModelCheckpoint(os.path.join(work_dir, "ckpt_{epoch}"), save_weights_only=True),
           schedule, callbacks.PrintLR()]
    # `fit` with its default progress bar, as the tutorial and the default run call it (the round's stdout goes to
    # a pipe): verbose=0 measured slower (docs/history.md, "How it was benchmarked"), so measuring with it would not
    # measure the run users get.
    wall, cpu, epoch_seconds = _timed_fit(model, train, cbs, epochs=epochs)
    return info.splits["train"].num_examples * epochs, wall, cpu, epoch_seconds


def project_round(data_dir, epochs, options, entrypoint=ENTRYPOINT):
    """The project's own run, `entrypoint` with `options`, in a fresh process: `fit`'s figures from its
    results.json, and the test accuracy of its restored checkpoint."""
    with tempfile.TemporaryDirectory(prefix="mnist-bench-run-") as output_dir:
        proc = subprocess.run([sys.executable, entrypoint, "--data-dir", data_dir, "--epochs", str(epochs),
                               "--output-dir", output_dir, *options], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the run {' '.join(options) or '(defaults)'} failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(output_dir, Config().results_file)) as f:
            figures = json.load(f)
    return (figures["train_images"], figures["train_seconds"], figures["train_cpu_seconds"],
            figures["train_epoch_seconds"]), figures["eval_accuracy_checkpoint"]


def resident(info, name):
    """The split `name` held in memory whatever --resident-limit-mb says: the ceiling's batches are in memory."""
    return data.split(info, name, limit_mb=float("inf"))


def resident_batches(split, global_batch, steps=None):
    """The first `steps` full batches (all of them by default) of the resident `split`, scaled, in the split's
    order: features (steps, batch, ...) and labels (steps, batch, ...)."""
    full = split.num_examples // global_batch
    full = min(full, steps) if steps else full

    def batches(cached):
        return tf.reshape(cached[:full * global_batch], (full, global_batch, *cached.shape[1:]))

    return tuple(batches(tf.convert_to_tensor(cached)) for cached in split.cache)


def ceiling_loop(strategy, model, images, labels):
    """One tf.function that runs the model's train step over every batch of `resident_batches`."""
    @tf.function
    def train_epoch():
        for i in tf.range(images.shape[0]):
            strategy.run(model.train_step, args=((images[i], labels[i]),))

    return train_epoch


def built_model(strategy, cfg, info, train, **compile_args):
    """The run's model for the scaled `train` split, built: its weights made before any step is traced."""
    features_shape, num_classes = data.model_input(train, info)
    with strategy.scope():
        model = compile_model(build_model(features_shape, num_classes), fused_adam=cfg.fused_adam, **compile_args)
        model.build((None, *features_shape))
    return model


def ceiling_round(info, cfg, strategy, epochs):
    """The train step alone: every batch already in memory, one tf.function looping over them."""
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    train = resident(info, "train")
    images, labels = resident_batches(train, global_batch)
    train_epoch = ceiling_loop(strategy, built_model(strategy, cfg, info, train), images, labels)
    train_epoch()  # trace and warm up outside the timing
    epoch_seconds, wall, cpu = timed(lambda: [timed(train_epoch)[1] for _ in range(epochs)])
    return int(images.shape[0]) * global_batch * epochs, wall, cpu, epoch_seconds


def split_fixed_cost(images, wall, epoch_seconds):
    """The round's rate over its epochs after the first (None with one epoch), and its fixed cost: the wall
    seconds beyond as many epochs at that rate (tracing and the first execution's graph optimisation, the end
    of `fit`). The ceiling, timed after its warm-up, has none; on a fast core the fixed cost of a short run
    weighs more than any per-step difference."""
    later = epoch_seconds[1:]
    if not later:
        return {"steady_images_per_s": None, "fixed_seconds": None}
    steady_epoch = statistics.median(later)
    return {"steady_images_per_s": images / len(epoch_seconds) / steady_epoch,
            "fixed_seconds": wall - len(epoch_seconds) * steady_epoch}


def rates(images, wall, cpu, epoch_seconds):
    return {"images_per_s": images / wall, "images_per_cpu_s": images / cpu,
            **split_fixed_cost(images, wall, epoch_seconds)}


def measure_one(name, data_dir, epochs):
    """One round of the tutorial or the ceiling, in this process, which is a fresh one for each round."""
    cfg = Config()
    info = data.load(cfg.dataset, data_dir)
    keras.utils.set_random_seed(cfg.seed)
    strategy = tf.distribute.MirroredStrategy()
    if name == "ceiling":
        return ceiling_round(info, cfg, strategy, epochs)
    with tempfile.TemporaryDirectory(prefix="mnist-bench-round-") as work_dir:
        return tutorial_round(data_dir, info, cfg, strategy, epochs, work_dir)


def run_one(name, data_dir, epochs, baseline=None):
    """Runs one round in a fresh process; its figures plus the machine's steal share while it ran. `baseline` is
    another checkout's folder, whose default run the round named BASELINE runs."""
    before = _cpu_ticks()
    if name in VARIANTS or name == BASELINE:
        timing, accuracy = (project_round(data_dir, epochs, VARIANTS[name]) if name in VARIANTS else
                            project_round(data_dir, epochs, [], os.path.join(baseline, os.path.basename(ENTRYPOINT))))
        figures = {**rates(*timing), "test_accuracy": accuracy}
    else:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--data-dir", data_dir, "--epochs",
                               str(epochs), "--one", name], capture_output=True, text=True)
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
    accuracy = f"   test accuracy {figures['test_accuracy']:.4f}" if "test_accuracy" in figures else ""
    return f"{figures['images_per_s']:8.0f} images/s {figures['images_per_cpu_s']:8.0f} images/CPU-s{steal}{accuracy}"


# ---------------------------------------------------------------- summary

def summarize(rounds, args):
    """Medians over rounds, and each pipeline's ratio to the ceiling and to the tutorial, for both rates."""
    results = {"cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(), "replicas": 1,
               "epochs_per_round": args.epochs, "rounds": args.rounds}
    for key in RATES:
        rates = {name: [r[key] for r in measured] for name, measured in rounds.items()}
        medians = {name: statistics.median(values) for name, values in rates.items()}
        results[key] = {name: [round(v, 1) for v in values] for name, values in rates.items()}
        results[f"median_{key}"] = {name: round(m, 1) for name, m in medians.items()}
        for baseline in BASELINES:
            prefix = "" if key == "images_per_s" else "cpu_"
            results[f"{prefix}ratio_to_{baseline}"] = {name: round(m / medians[baseline], 3) for name, m in medians.items()}
    results["steal_percent"] = {name: [r["steal_percent"] for r in measured] for name, measured in rounds.items()}
    # The project's runs and its variants' (the baselines do not evaluate).
    accuracies = {name: [r["test_accuracy"] for r in measured] for name, measured in rounds.items()
                  if "test_accuracy" in measured[0]}
    results["test_accuracy"] = accuracies
    results["median_test_accuracy"] = {name: round(statistics.median(values), 4) for name, values in accuracies.items()}
    if args.epochs > 1:  # the split needs epochs after the first
        steady = {name: statistics.median(r["steady_images_per_s"] for r in measured) for name, measured in rounds.items()}
        results["median_steady_images_per_s"] = {name: round(rate, 1) for name, rate in steady.items()}
        results["steady_ratio_to_ceiling"] = {name: round(rate / steady["ceiling"], 3) for name, rate in steady.items()}
        results["fixed_seconds"] = {name: [round(r["fixed_seconds"], 2) for r in measured] for name, measured in rounds.items()}
    return results


def print_table(results):
    split = "steady_ratio_to_ceiling" in results
    print(f"\n{'pipeline':<22} {'images/s':>9} {'x ceiling':>10} {'x tutorial':>11} {'images/CPU-s':>13} "
          f"{'x ceiling':>10} {'steal %':>8} {'test acc':>9}" + (f" {'later epochs x ceiling':>23} {'fixed s':>8}" if split else ""))
    for name, wall in results["median_images_per_s"].items():
        steal = [s for s in results["steal_percent"][name] if s is not None]
        later = (f" {results['steady_ratio_to_ceiling'][name]:>23.3f} {statistics.median(results['fixed_seconds'][name]):>8.2f}"
                 if split else "")
        print(f"{name:<22} {wall:>9.0f} {results['ratio_to_ceiling'][name]:>10.3f} "
              f"{results['ratio_to_tutorial'][name]:>11.2f} {results['median_images_per_cpu_s'][name]:>13.0f} "
              f"{results['cpu_ratio_to_ceiling'][name]:>10.3f} "
              f"{statistics.median(steal) if steal else float('nan'):>8.1f} "
              f"{results['median_test_accuracy'].get(name, float('nan')):>9.4f}" + later)
    for name in results["median_test_accuracy"]:
        if name != "project":
            print(against_project(results, name))
    print(f"\nproject: {results['ratio_to_ceiling']['project']:.3f} of the compute ceiling "
          f"(median of {results['rounds']} rounds, {results['epochs_per_round']} epochs each, first epoch included)")
    if split:
        print(f"project's epochs after the first: {results['steady_ratio_to_ceiling']['project']:.3f} of the ceiling's; "
              f"its fixed cost: {statistics.median(results['fixed_seconds']['project']):.2f} s a run (tracing, the first "
              f"execution, the end of fit), which the ceiling, timed after its warm-up, does not pay")


def against_project(results, name):
    """One line: the variant `name`'s rates and test accuracy against the project's (medians over rounds)."""
    accuracy, project = results["median_test_accuracy"][name], results["median_test_accuracy"]["project"]
    return (f"{name} against project: {results['ratio_to_project'][name]:.3f}x images/s, "
            f"{results['cpu_ratio_to_project'][name]:.3f}x images/CPU-s; test accuracy {accuracy:.4f} against "
            f"{project:.4f} ({100 * (accuracy - project):+.2f} points)")


def add_data_source(parser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--idx-dir", help="folder with the four MNIST IDX files (prepared into a temporary tfds dir)")
    source.add_argument("--data-dir", help="a prepared tfds data dir")


def prepared_data(args):
    """(a temporary folder to clean up, the data dir, tfds's info) of --idx-dir or --data-dir, the data checked
    (and prepared from --idx-dir) once, up front; UsageError where it cannot be used."""
    work = tempfile.TemporaryDirectory(prefix="mnist-bench-")
    data_dir = os.path.join(work.name, "tfds") if args.idx_dir else args.data_dir
    return work, data_dir, data.load(Config.dataset, data_dir, args.idx_dir)


def write_figures(results, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.write_json(path, results)
    print(f"figures written to {path}")


def report(results, print_table, path, work):
    """A benchmark's end: its table printed, its figures written to `path`, its prepared data (`work`) removed."""
    print_table(results)
    write_figures(results, path)
    work.cleanup()
    return EXIT_OK


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_source(parser)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every pipeline (at least 2 for a median)")
    parser.add_argument("--epochs", type=int, default=Config().epochs, help="full epochs per round (default: the default run's)")
    parser.add_argument("--quick", action="store_true", help=f"for development: {QUICK['epochs']} epochs, {QUICK['rounds']} rounds")
    parser.add_argument("--variants", default="project", help=f"comma-separated, from: {','.join(VARIANTS)}")
    parser.add_argument("--baseline", help="another checkout's folder: its default run joins every round, set against "
                                           "this one's")
    parser.add_argument("--output", default="benchmarks/throughput.json", help="JSON file for the figures")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one round in this process
    if parser.parse_args(argv).quick:
        parser.set_defaults(**QUICK)  # defaults only: --epochs or --rounds given beside --quick still win
    args = parser.parse_args(argv)
    if args.one:
        print(RESULT_MARK + json.dumps(rates(*measure_one(args.one, args.data_dir, args.epochs))))
        return EXIT_OK
    try:
        names = args.variants.split(",")
        unknown = set(names) - set(VARIANTS)
        if unknown:
            raise UsageError(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
        if "project" not in names:
            raise UsageError("--variants must include project, the run the ratios are about; add it")
        if args.baseline and not os.path.isfile(os.path.join(args.baseline, os.path.basename(ENTRYPOINT))):
            raise UsageError(f"--baseline {args.baseline} holds no {os.path.basename(ENTRYPOINT)}; give a checkout's folder")
        if args.rounds < 1 or args.epochs < 1:
            raise UsageError("--rounds and --epochs must be at least 1")
        work, data_dir, _ = prepared_data(args)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)

    rounds = {name: [] for name in ["tutorial", *names, *([BASELINE] if args.baseline else []), "ceiling"]}
    for round_ in range(args.rounds):
        # Every other round in reverse order, so that no pipeline always follows the same one.
        for name in (list(rounds) if round_ % 2 == 0 else reversed(list(rounds))):
            rounds[name].append(run_one(name, data_dir, args.epochs, args.baseline))
            print(f"round {round_ + 1}  {name:<22} {_describe(rounds[name][-1])}", flush=True)

    results = summarize(rounds, args)
    return report(results, print_table, args.output, work)


if __name__ == "__main__":
    sys.exit(main())
