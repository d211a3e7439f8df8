"""Where one replica's training step goes: the same steps several ways, alternated in one process.

    python benchmarks/step_cost.py --data-dir DIR                   # 30 rounds of an epoch's steps each
    python benchmarks/step_cost.py --idx-dir ../shared/datasets/mnist --rounds 10

`throughput.py` compares whole runs, each in a fresh process, whose speed moves from one process to the next by
more than a per-step difference of a few per cent (docs/performance.md, "How to benchmark"). Here every variant
lives in one process, traced and warmed up first, and each round runs each variant's steps in turn (in reverse
order every other round), so that the machine's drift hits all alike; each variant's time is read against the
ceiling's of the same round. The variants, each with a model of its own:

- ceiling: the train step looping inside one tf.function over batches already in memory (throughput.py's);
- keras_memory: Keras's own train function (the default run's steps a call) over the same batches, read through
  tf.data and `input_engine.distribute` as the run reads a single replica's input: what Keras's loop costs;
- keras_project: the run's own path: the cached split's batches gathered by shuffled indices on tf.data's thread
  (`data.training_input`), under MirroredStrategy;
- keras_project_default: the same under no strategy (TensorFlow's default), which shows what MirroredStrategy's
  handling of one replica costs;
- keras_project_multiworker: the same under MultiWorkerMirroredStrategy with one worker and no peers;
- keras_streamed: the run's path for a split larger than --resident-limit-mb: its examples read from tfds's
  record files, scaled, shuffled and batched one by one every epoch, under MirroredStrategy.
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

import data  # noqa: E402
from config import Config  # noqa: E402
from machinery import input_engine, terminal  # noqa: E402
from machinery.exits import EXIT_BAD_INPUT, UsageError  # noqa: E402
from throughput import (add_data_source, built_model, ceiling_loop, prepared_data, report, resident,  # noqa: E402
                        resident_batches, timed)  # benchmarks/ is this script's folder, first on sys.path

DEFAULT_ROUNDS = 30
BASELINE = "ceiling"


def keras_steps(strategy, cfg, info, train, feed, calls, steps_per_execution):
    """`calls` calls of a fresh model's Keras train function, `steps_per_execution` steps each, over what
    `feed(strategy)` gives, read as `fit` reads it."""
    model = built_model(strategy, cfg, info, train, steps_per_execution=steps_per_execution)
    iterator = iter(feed(strategy))
    train_function = model.make_train_function()

    def run():
        for _ in range(calls):
            train_function(iterator)

    return run


def variants(info, cfg, strategies, steps):
    """{name: a function running `steps` training steps}, and the steps each runs, a multiple of the calls'."""
    global_batch = cfg.batch_size_per_replica
    train = resident(info, "train")
    images, labels = resident_batches(train, global_batch, steps)
    available = int(images.shape[0])
    per_call = min(cfg.steps_per_execution, available)
    calls = available // per_call
    steps = calls * per_call
    images, labels = images[:steps], labels[:steps]
    stream = input_engine.Stream(num_examples=train.num_examples, global_batch=global_batch,
                                 buffer_size=cfg.buffer_size, seed=cfg.seed, epochs=1)

    def memory(strategy):
        return input_engine.distribute(strategy, lambda share: input_engine.for_distribution(
            tf.data.Dataset.from_tensor_slices((images, labels)).repeat()))

    def project(strategy):
        return data.training_input(strategy, train, stream)

    def streamed(strategy):
        return data.training_input(strategy, data.split(info, "train", limit_mb=0), stream)

    mirrored = strategies["mirrored"]
    runs = {
        BASELINE: ceiling_loop(mirrored, built_model(mirrored, cfg, info, train), images, labels),
        "keras_memory": keras_steps(mirrored, cfg, info, train, memory, calls, per_call),
    }
    for name, strategy in strategies.items():
        suffix = "" if name == "mirrored" else f"_{name}"
        runs[f"keras_project{suffix}"] = keras_steps(strategy, cfg, info, train, project, calls, per_call)
    runs["keras_streamed"] = keras_steps(mirrored, cfg, info, train, streamed, calls, per_call)
    return runs, steps


def measure(runs, rounds):
    """{name: [(wall, CPU seconds) a round]}, each round running every variant once, alternating the order."""
    for run in runs.values():
        run()  # trace and warm up outside the timing
    times = {name: [] for name in runs}
    order = list(runs)
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            _, wall, cpu = timed(runs[name])
            times[name].append((wall, cpu))
    return times


def summarize(times, steps):
    results = {"steps_a_round": steps, "rounds": len(times[BASELINE]), "variants": {}}
    for name, measured in times.items():
        ratios = [base[0] / own[0] for base, own in zip(times[BASELINE], measured)]
        results["variants"][name] = {
            "ms_a_step": round(1000 * statistics.median(wall for wall, _ in measured) / steps, 3),
            "cpu_ms_a_step": round(1000 * statistics.median(cpu for _, cpu in measured) / steps, 3),
            "ratio_to_ceiling": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        }
    return results


def print_table(results):
    print(f"\n{'variant':<26} {'ms a step':>10} {'CPU ms a step':>14} {'x ceiling (paired, median)':>27} {'range':>14}")
    for name, figures in results["variants"].items():
        low, high = figures["ratio_range"]
        print(f"{name:<26} {figures['ms_a_step']:>10.3f} {figures['cpu_ms_a_step']:>14.3f} "
              f"{figures['ratio_to_ceiling']:>27.3f} {low:>6.3f}-{high:<7.3f}")
    print(f"\n{results['rounds']} rounds of {results['steps_a_round']} steps, alternated in one process")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_source(parser)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds of every variant")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps a variant runs each round (unset: an epoch's full batches)")
    parser.add_argument("--output", default="benchmarks/step_cost.json", help="JSON file for the figures")
    args = parser.parse_args(argv)
    try:
        if args.rounds < 1 or (args.steps is not None and args.steps < 1):
            raise UsageError("--rounds and --steps must be at least 1")
        work, _, info = prepared_data(args)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)

    cfg = Config()
    # The multi-worker strategy first: it must configure TensorFlow's collectives before anything else runs.
    strategies = {"multiworker": tf.distribute.MultiWorkerMirroredStrategy(),
                  "mirrored": tf.distribute.MirroredStrategy(), "default": tf.distribute.get_strategy()}
    runs, steps = variants(info, cfg, strategies, args.steps)
    results = summarize(measure(runs, args.rounds), steps)
    return report(results, print_table, args.output, work)


if __name__ == "__main__":
    sys.exit(main())
