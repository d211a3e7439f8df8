"""A backup the command cannot continue (another model, another optimizer) is refused in one line, exit 2, naming
what differs and both ways out, and the output folder, backup included, is left byte for byte as it was; one
that another precision policy can continue resumes. The backup is a real one: a run of the entrypoint pre-empted
inside its second epoch."""

import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from machinery.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from processes import ROOT, Worker, finish, subprocess_env

FLAGS = ["--epochs", "2", "--batch-size-per-replica", "8", "--steps-per-execution", "5"]

# The template as a user adapts it: one more layer on top of whatever model.build_model builds, the rest of the
# entrypoint as it is.
ADAPTED = """
import sys

from machinery import terminal
import train_mnist_mirrored  # sets TensorFlow's environment, as a run does

terminal.start_tensorflow(verbose=False)  # its start-up notices held back, as in a run
import model
from model import keras

built_by_model_py = model.build_model


def build_model(image_shape, num_classes):
    return keras.Sequential([keras.Input(shape=image_shape), *built_by_model_py(image_shape, num_classes).layers,
                             keras.layers.Dense(num_classes, dtype="float32")])


model.build_model = build_model
sys.exit(train_mnist_mirrored.main(sys.argv[1:]))
"""


def _layers_with_weights():
    """How many layers with weights model.py's model has; a checkpoint numbers them from 0."""
    import data
    import model

    return sum(1 for layer in model.build_model(*data.image_shape_and_classes()).layers if layer.weights)


def _args(data_dir, output_dir, *extra):
    return [*FLAGS, "--data-dir", data_dir, "--output-dir", output_dir, *extra]


def _contents(folder):
    """{path: sha256} of every file under `folder`."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, resume_data_dir):
    """The output folder of a default run (fused Adam, the tutorial's model) pre-empted inside epoch 2."""
    directory = tmp_path_factory.mktemp("foreign_backup")
    output_dir = str(directory / "out")
    worker = Worker(_args(resume_data_dir, output_dir), {}, directory, "run")
    try:
        worker.wait_for("Epoch 2/2")
        worker.proc.send_signal(signal.SIGTERM)
    finally:
        finish([worker], timeout=120)
    assert worker.returncode == EXIT_PREEMPTED, worker.stderr[-3000:]
    assert os.path.isdir(os.path.join(output_dir, "backup"))
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize("program, extra, words", [
    # Keras's own Adam would find none of the fused Adam's slots (tf_keras: "a legacy TF-Keras optimizer").
    ("train_mnist_mirrored.py", ["--no-fused-adam"],
     ["made with --fused-adam", "this run is with --no-fused-adam", "rerun with --fused-adam"]),
    # One more layer with weights: the backup holds none of its variables.
    (ADAPTED, [], ["another model", "layer_with_weights-{top}/bias is only here",
                   "layer_with_weights-{top}/kernel is only here;", "the model.py that made it"]),
], ids=["no-fused-adam", "another-model"])
def test_a_backup_the_command_cannot_continue_is_refused_and_kept(program, extra, words, preempted, tmp_path,
                                                                  resume_data_dir):
    output_dir = str(tmp_path / "out")
    shutil.copytree(preempted, output_dir)
    before = _contents(output_dir)
    command = ["train_mnist_mirrored.py"] if program.endswith(".py") else ["-c", program]
    proc = subprocess.run([sys.executable, *command, *_args(resume_data_dir, output_dir, *extra)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: the backup in "), proc.stderr[-3000:]
    for word in [*words, "to resume it, or add --overwrite to start over"]:
        word = word.format(top=_layers_with_weights())  # the added layer's place: after model.py's own
        assert word in lines[0], (word, lines[0])
    assert _contents(output_dir) == before


@pytest.mark.slow
def test_a_backup_resumes_under_another_precision_policy(preempted, tmp_path, resume_data_dir):
    # The weights and Adam's slots are float32 under every policy: a float32 backup resumes in bfloat16.
    output_dir = str(tmp_path / "out")
    shutil.copytree(preempted, output_dir)
    proc = subprocess.run([sys.executable, "train_mnist_mirrored.py",
                           *_args(resume_data_dir, output_dir, "--mixed-precision", "bfloat16")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["dtype_policy"] == "mixed_bfloat16" and results["resumed_from_step"] > 0
