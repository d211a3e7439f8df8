"""Multi-worker scaling: the default run on one replica, on one worker, and on two workers, one core each.

    python benchmarks/scaling.py --data-dir DIR            # per-replica batch 64 and 256, 2 epochs, 2 rounds
    python benchmarks/scaling.py --data-dir DIR --quick    # batch 64, 1 epoch of at most 100 steps, 2 rounds
    python benchmarks/scaling.py --data-dir DIR --allreduce-dtype bfloat16   # and two workers all-reducing in it

Each configuration runs train_mnist_mirrored.py itself, in fresh processes, on a prepared data dir:

- 1 replica: `--strategy mirrored` on the first core;
- 1 worker: `--strategy multiworker` with a one-worker TF_CONFIG, on the first core;
- 2 workers: two processes on loopback, one core each, with the same per-replica batch (so twice the global batch);
- with --allreduce-dtype, 2 workers again, all-reducing their gradients in that type, in the same rounds.

Every process is pinned to its core (sched_setaffinity, as `taskset -c` does) and told to use one thread for
TensorFlow's op pools (TF_NUM_INTRAOP_THREADS=1, TF_NUM_INTEROP_THREADS=1): pinned alone, TensorFlow still sizes its
pools for every core of the machine, and one core then runs twice the threads, which slows a bare train step
(docs/history.md, "Figures from the code's comments"). A configuration's figure is the run's own
`train_images_per_s` (training images over the wall seconds of `fit`, first epoch and tracing included), and its
images per CPU-second of `fit`, summed over its processes (`train_cpu_seconds` of results.json), which neither the
hypervisor's steal nor other programs' load on the machine blurs as much. The rounds alternate the order of the
configurations (A B C, then C B A), and the table gives medians over rounds with the load average when each run
started (`uptime`'s first figure): on a shared machine only figures measured side by side in one run compare.

The 2-worker efficiency is the 2-worker images/s over twice the 1-replica images/s: 1.0 would be perfect
scaling; the CPU efficiency is the same ratio of images per CPU-second. Figures go to benchmarks/scaling.json.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machinery import outputs, terminal  # noqa: E402  (they import nothing heavy)
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, UsageError  # noqa: E402

ENTRYPOINT = os.path.join(ROOT, "train_mnist_mirrored.py")
CONFIGURATIONS = ("1 replica", "1 worker", "2 workers")
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
QUICK = {"epochs": 1, "steps_per_epoch": 100, "batches": "64", "rounds": 2}
RUN_TIMEOUT_S = 1800
RATES = ("images_per_s", "images_per_cpu_s")  # wall (what a user waits for), CPU (what load blurs less)
# Bytes sent over loopback, where the workers' all-reduce runs: the whole run's, start-up and evaluation included.
# /proc/net/dev is this process's network namespace's (/sys/class/net is that of whoever mounted /sys).
NET_DEV = "/proc/net/dev"
TX_BYTES = 8  # the column after the interface's name: 8 receive figures, then transmit's bytes


def loopback_bytes():
    try:
        with open(NET_DEV) as f:
            for line in f:
                name, _, figures = line.partition(":")
                if name.strip() == "lo":
                    return int(figures.split()[TX_BYTES])
    except OSError:
        pass
    return None


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def printed_figures(stdout):
    """The results JSON every worker prints (only the chief writes results.json)."""
    start = stdout.index("\n{") + 1
    return json.JSONDecoder().raw_decode(stdout, start)[0]


def run_pinned(command, workers, *, what, multiworker=True, timeout=RUN_TIMEOUT_S):
    """Runs `command` as `workers` processes, each pinned to its own core (as `taskset -c` does, cycling through
    this process's cores) with one-thread op pools and, with `multiworker`, as worker `index` of a loopback
    cluster in TF_CONFIG; returns their stdouts, or raises RuntimeError with `what` and a failed one's stderr."""
    cores = sorted(os.sched_getaffinity(0))
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(workers)]}
    procs = []
    for index in range(workers):
        env = {**os.environ, **ONE_THREAD, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.pop("TF_CONFIG", None)
        if multiworker:
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        core = cores[index % len(cores)]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, preexec_fn=lambda core=core: os.sched_setaffinity(0, {core})))
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, stderr) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{stderr[-3000:]}")
    return [stdout for stdout, _ in outputs]


def configurations(allreduce_dtype):
    """The configurations to run: the three, and with `allreduce_dtype` two workers all-reducing in it too."""
    return CONFIGURATIONS + ((f"2 workers, {allreduce_dtype}",) if allreduce_dtype else ())


def run_configuration(name, args, batch, work_dir):
    """Runs one configuration in fresh processes; returns its figures."""
    cores = sorted(os.sched_getaffinity(0))
    workers = 2 if name.startswith("2 workers") else 1
    output_dir = tempfile.mkdtemp(prefix="run-", dir=work_dir)
    command = [sys.executable, ENTRYPOINT, "--data-dir", args.data_dir, "--output-dir", output_dir,
               "--epochs", str(args.epochs), "--batch-size-per-replica", str(batch)]
    if args.steps_per_epoch:
        command += ["--steps-per-epoch", str(args.steps_per_epoch)]
    if name != "1 replica":
        command += ["--strategy", "multiworker"]
    if name.startswith("2 workers, "):
        command += ["--allreduce-dtype", name.split(", ")[1]]
    load = os.getloadavg()[0]
    sent_before = loopback_bytes()
    stdouts = run_pinned(command, workers, what=f"{name} (batch {batch})", multiworker=name != "1 replica")
    sent_after = loopback_bytes()
    figures = [printed_figures(stdout) for stdout in stdouts]
    chief = figures[0]
    cpu = sum(f["train_cpu_seconds"] for f in figures)
    steps = chief["train_images"] / chief["global_batch_size"]
    sent = None if sent_before is None or workers == 1 else (sent_after - sent_before) / steps
    return {"images_per_s": chief["train_images_per_s"], "images_per_cpu_s": chief["train_images"] / cpu,
            "loopback_bytes_per_step": sent,
            "train_images": chief["train_images"], "global_batch": chief["global_batch_size"],
            "cpu_seconds": [f["train_cpu_seconds"] for f in figures], "load_average": load,
            "cores": [cores[index % len(cores)] for index in range(workers)]}


def summarize(rounds, args):
    """Medians per batch and configuration, the one-worker overhead and the 2-worker efficiency."""
    results = {"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch, "rounds": args.rounds,
               "cpu_cores": len(os.sched_getaffinity(0)), "batches": {}}
    for batch, measured in rounds.items():
        medians = {name: {key: statistics.median(r[key] for r in runs) for key in RATES}
                   for name, runs in measured.items()}
        single, one, two = (medians[name] for name in CONFIGURATIONS)
        results["batches"][batch] = {
            "runs": measured,
            "medians": medians,
            "one_worker_ratio": one["images_per_s"] / single["images_per_s"],
            "one_worker_cpu_ratio": one["images_per_cpu_s"] / single["images_per_cpu_s"],
            "efficiency": two["images_per_s"] / (2 * single["images_per_s"]),
            "cpu_efficiency": two["images_per_cpu_s"] / single["images_per_cpu_s"],
        }
        for name in set(medians) - set(CONFIGURATIONS):  # two workers all-reducing in another type
            results["batches"][batch][f"efficiency, {name}"] = medians[name]["images_per_s"] / (2 * single["images_per_s"])
            results["batches"][batch][f"cpu_efficiency, {name}"] = (medians[name]["images_per_cpu_s"]
                                                                     / single["images_per_cpu_s"])
    return results


def print_table(results):
    print(f"\n{'per-replica batch':>17} {'configuration':<20} {'global':>6} {'images/s':>9} {'images/CPU-s':>13} "
          f"{'load avg':>9}  rounds (images/s)")
    for batch, figures in results["batches"].items():
        for name in figures["runs"]:
            runs, median = figures["runs"][name], figures["medians"][name]
            loads = "/".join(f"{r['load_average']:.1f}" for r in runs)
            sent = [r["loopback_bytes_per_step"] for r in runs if r.get("loopback_bytes_per_step")]
            print(f"{batch:>17} {name:<20} {runs[0]['global_batch']:>6} {median['images_per_s']:>9,.0f} "
                  f"{median['images_per_cpu_s']:>13,.0f} {loads:>9}  "
                  + ", ".join(f"{r['images_per_s']:,.0f}" for r in runs)
                  + (f"  loopback {statistics.median(sent) / 1e6:.2f} MB a step" if sent else ""))
        print(f"{batch:>17} 1 worker / 1 replica: {figures['one_worker_ratio']:.2f} (CPU {figures['one_worker_cpu_ratio']:.2f});"
              f" 2-worker efficiency: {figures['efficiency']:.2f} (CPU {figures['cpu_efficiency']:.2f})")
        for name in figures["runs"]:
            if f"efficiency, {name}" in figures:
                print(f"{batch:>17} {name}: efficiency {figures[f'efficiency, {name}']:.2f} "
                      f"(CPU {figures[f'cpu_efficiency, {name}']:.2f})")
    print(f"\nmedians of {results['rounds']} alternated rounds, {results['epochs']} epoch(s) each"
          + (f" of at most {results['steps_per_epoch']} steps" if results["steps_per_epoch"] else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="a prepared tfds data dir (python prepare_mnist.py ...)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run")
    parser.add_argument("--steps-per-epoch", type=int, default=None, help="train at most this many steps an epoch")
    parser.add_argument("--batches", default="64,256", help="comma-separated per-replica batch sizes")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration (at least 2 for a median)")
    parser.add_argument("--quick", action="store_true",
                        help="for development: batch 64, 1 epoch of at most 100 steps, 2 rounds")
    parser.add_argument("--allreduce-dtype", choices=("bfloat16", "float16"), default=None,
                        help="also run two workers that all-reduce their gradients in this type, side by side")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "scaling.json"),
                        help="JSON file for the figures")
    if parser.parse_args(argv).quick:
        parser.set_defaults(**QUICK)  # defaults only: options given beside --quick still win
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if args.rounds < 1 or args.epochs < 1 or min(batches) < 1:
            raise UsageError("--rounds, --epochs and every --batches size must be at least 1")
        if not os.path.isdir(args.data_dir):
            raise UsageError(f"--data-dir {args.data_dir} does not exist; prepare it with python prepare_mnist.py")
    except ValueError:
        return terminal.stopped(EXIT_BAD_INPUT, f"--batches {args.batches} is not a comma-separated list of whole "
                                                "numbers; e.g. --batches 64,256")
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)

    names = configurations(args.allreduce_dtype)
    rounds = {batch: {name: [] for name in names} for batch in batches}
    with tempfile.TemporaryDirectory(prefix="mnist-scaling-") as work_dir:
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for batch in batches:
                for name in order:
                    figures = run_configuration(name, args, batch, work_dir)
                    rounds[batch][name].append(figures)
                    print(f"round {round_ + 1}  batch {batch:>4}  {name:<20} {figures['images_per_s']:>9,.0f} images/s "
                          f"{figures['images_per_cpu_s']:>9,.0f} images/CPU-s  load {figures['load_average']:.1f}",
                          flush=True)
    results = summarize(rounds, args)
    print_table(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    outputs.write_json(args.output, results)
    print(f"figures written to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
