"""Whole runs of the entrypoint: the smoke run's flags, a run to its end with its results.json, its final weights."""

import json
import os
import pathlib
import re

import numpy as np

from processes import ROOT, run_entrypoint


# ---------------------------------------------------------------- the smoke run (conftest.smoke_run)

# The smoke run's flags; tests compare results.json against these, not against the code's own output.
SMOKE_EPOCHS = 1
SMOKE_STEPS = 3
SMOKE_BATCH = 16
# Mirror over two logical CPUs where the machine has two cores, so "global = per-replica x replicas" is
# checked with more than one replica; validate() refuses more replicas than cores.
SMOKE_CPU_REPLICAS = 2 if (os.cpu_count() or 1) >= 2 else 0


def smoke_args(data_dir, output_dir):
    return ["--epochs", str(SMOKE_EPOCHS), "--steps-per-epoch", str(SMOKE_STEPS),
            "--batch-size-per-replica", str(SMOKE_BATCH), "--data-dir", data_dir, "--output-dir", output_dir]


class SmokeRun:
    def __init__(self, proc, output_dir):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.output_dir = output_dir

    def path(self, *names):
        return os.path.join(self.output_dir, *names)

    @property
    def results(self):
        with open(self.path("results.json")) as f:
            return json.load(f)


# ---------------------------------------------------------------- a whole run to its end

def finished(args, directory, timeout=600, script="train_mnist_mirrored.py"):
    """Runs the entrypoint with `args`, which name its --output-dir, to its end (run_entrypoint: a Worker of its own
    under `directory`); asserts that it exited 0 with no traceback, and returns (its output folder, its stdout, its
    results.json)."""
    output_dir = pathlib.Path(args[args.index("--output-dir") + 1])
    worker = run_entrypoint(args, directory, timeout=timeout, script=script)
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "Traceback" not in worker.stderr, worker.stderr[-3000:]
    return output_dir, worker.stdout, json.loads((output_dir / "results.json").read_text())


# ---------------------------------------------------------------- what a finished run leaves

def documented_outputs():
    """The names the README's "Outputs" table gives, at the top of --output-dir."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("\n## Outputs\n", 1)[1].split("\n## ", 1)[0]
    return {re.split(r"[/`]", cell)[0] for cell in re.findall(r"^\| `([^`]+)`", section, re.M)}


def assert_only_documented_outputs(output_dir):
    """A finished run's folder holds what the README's "Outputs" documents, the lock aside (it goes as the run ends),
    and nothing half-written inside: Keras's non-chief copies, or a write not yet renamed into place."""
    from config import Config

    assert set(os.listdir(output_dir)) == documented_outputs() - {Config().lock_file}, output_dir
    leftovers = [str(path) for path in pathlib.Path(output_dir).rglob("*")
                 if re.search(r"workertemp|partial|_temp", path.name)]
    assert leftovers == []


# ---------------------------------------------------------------- the weights a run ends with

def final_weights(output_dir, epochs):
    """{variable name: array} of the model's layers in the last per-epoch checkpoint, which must be epoch `epochs`'s."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(os.path.join(output_dir, "training_checkpoints"))
    assert path.endswith(f"ckpt_{epochs}")
    ckpt = tf.train.load_checkpoint(path)
    names = sorted(n for n, _ in tf.train.list_variables(path) if n.startswith("layer_with_weights"))
    assert names, "the checkpoint must hold the model's layers"
    return {n: ckpt.get_tensor(n) for n in names}


def max_abs_diff(a, b):
    """The largest absolute difference between two lists of arrays (a model's weights, say)."""
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))
