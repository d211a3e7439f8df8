"""TensorFlow 2.21 cannot XLA-compile an all-reduce between CPU workers, and the failure then aborts both workers.

Minimal reproducer, fit for an upstream report (tensorflow/tensorflow). Run: `python xla_cpu_collectives.py`; it
starts two workers of MultiWorkerMirroredStrategy on loopback, each summing one number with every other worker's
inside a `tf.function(jit_compile=True)`.

- Expected: each worker prints the sum, 1.0 + 2.0 = 3.0, as it does without `jit_compile` (`python
  xla_cpu_collectives.py --no-jit`).
- Seen with tensorflow 2.21.0 (pip, CPU) on an AMD EPYC: both workers exit 1 with `UnimplementedError: Collectives
  are not yet implemented for CPU devices when compiling with XLA`. Inside Keras's `fit` the same error is followed
  by both workers aborting (exit 134, `bfc_allocator.cc ... Check failed: c->in_use()`).
- Why it matters: Keras's `compile(jit_compile=True)` compiles the train step, gradients' all-reduce included, so
  `--jit-compile --strategy multiworker` on CPUs cannot train. mnist-mirrored refuses that pair before it starts
  (README, "Options"); with GPUs, which XLA's collectives serve, it is allowed.
"""

import json
import os
import socket
import subprocess
import sys

WORKERS = 2
SECONDS = 300


def worker(jit):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    mine = float(1 + strategy.cluster_resolver.task_id)

    @tf.function(jit_compile=jit)
    def summed():
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(mine))

    print(f"worker sum: {strategy.experimental_local_results(strategy.run(summed))[0].numpy()}", flush=True)


def main(jit):
    sockets = [socket.socket() for _ in range(WORKERS)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--jit" if jit else "--no-jit"],
                              env={**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster,
                                                                          "task": {"type": "worker", "index": i}})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(WORKERS)]
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if line.strip()]
        print(f"worker {i}: exit {proc.returncode}")
        print("\n".join("    " + line[:200] for line in lines[-4:]))


if __name__ == "__main__":
    jit = "--no-jit" not in sys.argv
    worker(jit) if "--worker" in sys.argv else main(jit)
