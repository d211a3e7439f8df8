"""The whole default command, from the shell to its exit, phase by phase, beside the model's compute ceiling.

    python benchmarks/phases.py --data-dir DIR                 # 12 epochs (the default run's), 3 rounds
    python benchmarks/phases.py --idx-dir DIR --epochs 3 --rounds 2
    python benchmarks/phases.py --data-dir DIR --baseline OTHER_CHECKOUT   # the same, beside another version

Each round runs, each in a fresh process, in an order that alternates round by round: the default command
(`python train_mnist_mirrored.py --data-dir D --output-dir O --epochs N`), timed from its start to its exit, and
throughput.py's compute ceiling (the model's train step alone at full rate, tracing excluded). The run's phases
come from what it records in results.json: the Unix time at which each phase ended (`phase_ends`) and each
epoch's seconds; the first phase starts and the last ends with the process.

It prints each phase's median seconds, and three ratios:
- the whole command's seconds over the seconds the ceiling needs for the same training images, in wall time
  and in CPU time (the process and its threads; what a shared machine's hypervisor steals does not count);
- the whole command's seconds over its own epochs', each at the rate of its later epochs: the fixed seconds alone,
  on a CPU where the epochs themselves run slower than the ceiling;
- the first epoch's seconds over a later epoch's (the median of the others): tracing, the first execution and
  TensorBoard's graph are the first epoch's.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import throughput
from throughput import ENTRYPOINT, ROOT  # noqa: F401  (ROOT: throughput put the project on the path)

from config import Config  # noqa: E402
from machinery import terminal  # noqa: E402
from machinery.exits import EXIT_BAD_INPUT, UsageError  # noqa: E402

# The run's phases, in order, each named by the stamp at its end (machinery/phase_clock.py: the steps marked
# @ends); between "model" and "fit" the epochs are split out of `fit` by its epoch clock.
STAMPED = (
    ("interpreter", "interpreter start"),
    ("imports", "the entrypoint's imports"),
    ("tensorflow", "flags checked, TensorFlow imported and started"),
    ("strategy", "step 1: the strategy"),
    ("libraries", "tf_keras, tfds and the run's modules imported"),
    ("data", "step 2: the data read"),
    ("model", "step 3: the model built and compiled"),
)
FIT = (("first_epoch", "step 4: the first epoch"), ("later_epochs", "step 4: the later epochs"),
       ("fit_rest", "step 4: fit beyond its epochs"))
AFTER_FIT = (
    ("restore", "step 5: checkpoint restored and evaluated"),
    ("export", "step 6: SavedModel and model.keras written"),
    ("reload", "step 6: SavedModel reloaded twice, evaluated"),
    ("exit", "results written, summary, exit"),
)
LABELS = dict(STAMPED + FIT + AFTER_FIT)
BARS = {"whole_over_ceiling": 1.15, "first_over_later_epoch": 1.15}  # the project's targets for both, printed beside the ratios


def _children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every child waited for, all its threads
    return usage.ru_utime + usage.ru_stime


def whole_command(entrypoint, data_dir, epochs):
    """One run of `entrypoint` with the default options in a fresh process: its wall and CPU seconds from start to
    exit, and its results.json."""
    with tempfile.TemporaryDirectory(prefix="mnist-phases-run-") as output_dir:
        command = [sys.executable, entrypoint, "--data-dir", data_dir, "--output-dir", output_dir,
                   "--epochs", str(epochs)]
        cpu, start = _children_cpu_seconds(), time.time()
        proc = subprocess.run(command, cwd=os.path.dirname(entrypoint), capture_output=True, text=True)
        wall, cpu = time.time() - start, _children_cpu_seconds() - cpu
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(output_dir, Config().results_file)) as f:
            figures = json.load(f)
    return start, wall, cpu, figures


def phases(start, wall, figures):
    """Each phase's seconds, in order, from the run's stamps and epoch seconds and the process's start and end."""
    ends = figures["phase_ends"]
    seconds, previous = {}, start
    for name, _ in STAMPED:
        seconds[name], previous = ends[name] - previous, ends[name]
    epochs = figures["train_epoch_seconds"]
    seconds["first_epoch"], seconds["later_epochs"] = epochs[0], sum(epochs[1:])
    seconds["fit_rest"], previous = ends["fit"] - previous - sum(epochs), ends["fit"]
    for name, _ in AFTER_FIT[:-1]:
        seconds[name], previous = ends[name] - previous, ends[name]
    seconds["exit"] = start + wall - previous
    return seconds


def against_ceiling(run, ceiling):
    """One round of a command (whole_command's figures): its phases, and its ratios to the ceiling's rates
    measured in the same round."""
    start, wall, cpu, figures = run
    images, epoch_seconds = figures["train_images"], figures["train_epoch_seconds"]
    return {
        "wall_seconds": wall, "cpu_seconds": cpu, "train_images": images,
        "test_accuracy": figures["eval_accuracy_checkpoint"],
        "phases": phases(start, wall, figures),
        "ceiling_seconds": images / ceiling["images_per_s"],
        "whole_over_ceiling": wall / (images / ceiling["images_per_s"]),
        "cpu_whole_over_ceiling": cpu / (images / ceiling["images_per_cpu_s"]),
        "first_over_later_epoch": (epoch_seconds[0] / statistics.median(epoch_seconds[1:])
                                   if len(epoch_seconds) > 1 else None),
        # The command over its own epochs, each at the later epochs' rate: how far the whole command is from
        # its epochs alone, whatever the epochs' rate against the ceiling on this CPU.
        "whole_over_own_epochs": (wall / (len(epoch_seconds) * statistics.median(epoch_seconds[1:]))
                                  if len(epoch_seconds) > 1 else None),
    }


def median_of(rounds, key):
    values = [r[key] for r in rounds if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(rounds, ceilings, args):
    results = {"cpu_model": throughput._cpu_model(), "cpu_cores": os.cpu_count(), "epochs": args.epochs,
               "rounds": args.rounds, "ceiling_images_per_s": [round(c["images_per_s"], 1) for c in ceilings],
               "ceiling_images_per_cpu_s": [round(c["images_per_cpu_s"], 1) for c in ceilings],
               "ceiling_steal_percent": [c["steal_percent"] for c in ceilings], "commands": {}}
    for name, measured in rounds.items():
        results["commands"][name] = {
            **{key: median_of(measured, key) for key in ("wall_seconds", "cpu_seconds", "ceiling_seconds",
                                                        "whole_over_ceiling", "cpu_whole_over_ceiling",
                                                        "first_over_later_epoch", "whole_over_own_epochs",
                                                        "test_accuracy")},
            "phase_seconds": {phase: round(statistics.median(r["phases"][phase] for r in measured), 3)
                              for phase in LABELS},
            "rounds": measured,
        }
    return results


def print_table(results):
    names = list(results["commands"])
    commands = [results["commands"][name] for name in names]
    print(f"\n{'phase (median seconds)':<48}" + "".join(f"{name:>12}" for name in names))
    for phase, label in LABELS.items():
        print(f"{label:<48}" + "".join(f"{c['phase_seconds'][phase]:>12.2f}" for c in commands))
    rows = (("whole command, wall seconds", "wall_seconds", ".2f"),
            ("the ceiling's seconds for the same images", "ceiling_seconds", ".2f"),
            (f"whole command / ceiling (bar {BARS['whole_over_ceiling']})", "whole_over_ceiling", ".3f"),
            ("the same in CPU seconds", "cpu_whole_over_ceiling", ".3f"),
            ("whole command / its epochs at the later rate", "whole_over_own_epochs", ".3f"),
            (f"first epoch / a later one (bar {BARS['first_over_later_epoch']})", "first_over_later_epoch", ".3f"),
            ("test accuracy", "test_accuracy", ".4f"))
    for label, key, fmt in rows:
        print(f"{label:<48}" + "".join(f"{'-' if c[key] is None else format(c[key], fmt):>12}" for c in commands))
    print(f"\n{results['cpu_model']}, {results['cpu_cores']} cores; medians of {results['rounds']} rounds of "
          f"{results['epochs']} epochs; ceiling {statistics.median(results['ceiling_images_per_s']):.0f} images/s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_data_source(parser)
    parser.add_argument("--epochs", type=int, default=Config().epochs, help="epochs a run (default: the default run's)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the command and the ceiling")
    parser.add_argument("--baseline", help="another checkout of the project, whose command runs beside this one's")
    parser.add_argument("--output", default="benchmarks/phases.json", help="JSON file for the figures")
    args = parser.parse_args(argv)
    try:
        if args.rounds < 1 or args.epochs < 2:
            raise UsageError("--rounds must be at least 1 and --epochs at least 2 (a first epoch and a later one)")
        entrypoints = {"command": ENTRYPOINT}
        if args.baseline:
            entrypoints["baseline"] = os.path.join(os.path.abspath(args.baseline), os.path.basename(ENTRYPOINT))
            if not os.path.isfile(entrypoints["baseline"]):
                raise UsageError(f"--baseline {args.baseline} holds no {os.path.basename(ENTRYPOINT)}; "
                                 "name a checkout of this project")
        work, data_dir, _ = throughput.prepared_data(args)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)

    rounds, ceilings = {name: [] for name in entrypoints}, []
    for round_ in range(args.rounds):
        order = [*entrypoints, "ceiling"]
        runs = {}
        for name in order if round_ % 2 == 0 else reversed(order):  # none always first on a drifting machine
            if name == "ceiling":
                ceilings.append(throughput.run_one("ceiling", data_dir, args.epochs))
            else:
                runs[name] = whole_command(entrypoints[name], data_dir, args.epochs)
        print(f"round {round_ + 1}  ceiling   {throughput._describe(ceilings[-1])}", flush=True)
        for name, run in runs.items():
            rounds[name].append(against_ceiling(run, ceilings[-1]))
            measured = rounds[name][-1]
            print(f"round {round_ + 1}  {name:<9} {measured['wall_seconds']:6.2f} s, "
                  f"{measured['whole_over_ceiling']:.3f} x the ceiling's", flush=True)
    results = summarize(rounds, ceilings, args)
    return throughput.report(results, print_table, args.output, work)


if __name__ == "__main__":
    sys.exit(main())
