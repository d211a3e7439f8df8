"""The multi-worker all-reduce alone: two workers on loopback, one core and one thread each, all-reducing a tensor
again and again in a `tf.function`, as the gradients are all-reduced at every training step.

    python benchmarks/allreduce.py                 # model.py's model's gradients in float32 and bfloat16, and 4 bytes
    python benchmarks/allreduce.py --repeats 50    # fewer, for a quick look

For each case it prints the bytes of the tensor, and per all-reduce the wall milliseconds and the CPU
milliseconds of each worker (its whole process, TensorFlow's threads included), medians over rounds. Beside a
training step's time (benchmarks/scaling.py), this says how much of what a second worker adds is the all-reduce
itself (docs/performance.md, "Several workers").
"""

import argparse
import json
import statistics
import sys
import textwrap

from projection import model_facts  # benchmarks/ is this script's folder, first on sys.path
from scaling import run_pinned  # which also puts the project on sys.path
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK
from machinery import terminal
TIMEOUT_S = 600

# Runs in each worker: prints {case: [(wall s, CPU s) per round]} as JSON.
WORKER = textwrap.dedent("""
    import json, sys, time
    import tensorflow as tf

    cases, repeats, rounds = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    out = {}
    for name, size, dtype in cases:
        @tf.function
        def all_reduce_many():
            def on_replica():
                # Made in the replica function, so that it is on the replica's device (resume._any_worker).
                x = tf.ones([size], dtype)
                context = tf.distribute.get_replica_context()
                for _ in range(repeats):  # unrolled: each all-reduce its own op, as each step's is
                    x = context.all_reduce(tf.distribute.ReduceOp.SUM, x) * tf.constant(0.5, dtype)
                return x
            return strategy.run(on_replica)

        all_reduce_many()  # traced, and the collective's group formed
        out[name] = []
        for _ in range(rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            all_reduce_many()
            out[name].append(((time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats))
    print(json.dumps(out))
""")


def measure(cases, repeats, rounds):
    """{case: {"wall_ms": ..., "cpu_ms": [worker 0, worker 1]}}, medians over rounds, per all-reduce."""
    stdouts = run_pinned([sys.executable, "-c", WORKER, json.dumps(cases), str(repeats), str(rounds)], 2,
                         what="a worker", timeout=TIMEOUT_S)
    figures = [json.loads(stdout.strip().splitlines()[-1]) for stdout in stdouts]
    return {name: {"wall_ms": 1000 * statistics.median(wall for wall, _ in figures[0][name]),
                   "cpu_ms": [1000 * statistics.median(cpu for _, cpu in worker[name]) for worker in figures]}
            for name, _, _ in cases}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="all-reduces in one timed call")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls; the medians are printed")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        return terminal.stopped(EXIT_BAD_INPUT, "--repeats and --rounds must be at least 1; e.g. --repeats 100 --rounds 3")
    parameters = model_facts()[0]  # one gradient each, in the model model.py builds
    cases = (("gradients, float32", parameters, "float32"), ("gradients, bfloat16", parameters, "bfloat16"),
             ("4 bytes, float32", 1, "float32"))
    results = measure(cases, args.repeats, args.rounds)
    print(f"{'all-reduce of':<20} {'bytes':>10} {'wall ms':>8} {'CPU ms, worker 0 / 1':>22}")
    for name, size, dtype in cases:
        bytes_ = size * (4 if dtype == "float32" else 2)
        figures = results[name]
        print(f"{name:<20} {bytes_:>10,} {figures['wall_ms']:>8.2f} "
              f"{figures['cpu_ms'][0]:>10.2f} / {figures['cpu_ms'][1]:.2f}")
    print(f"\ntwo workers on loopback, one core and one thread each; medians of {args.rounds} calls of "
          f"{args.repeats} all-reduces")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
