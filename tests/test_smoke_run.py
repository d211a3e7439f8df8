"""One real run of the entrypoint (conftest's smoke_run) and what it leaves behind."""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import data
import export
import model
import train_mnist_mirrored
from processes import ROOT, subprocess_env
from runs import SMOKE_BATCH, SMOKE_CPU_REPLICAS, SMOKE_EPOCHS, SMOKE_STEPS, assert_only_documented_outputs
from small_data import NUM_TEST, NUM_TRAIN, scaled

IMAGE_SHAPE, NUM_CLASSES = data.image_shape_and_classes()  # from tfds's DatasetInfo


def built_model():
    """model.py's model, as the run builds it: its variables made (a subclassed model makes them at its first call)."""
    net = model.build_model(IMAGE_SHAPE, NUM_CLASSES)
    train_mnist_mirrored.make_variables(tf, net, tf.TensorSpec(IMAGE_SHAPE, tf.float32))
    return net


# ---------------------------------------------------------------- the run itself

def test_smoke_run_exits_zero(smoke_run):
    assert smoke_run.returncode == 0, smoke_run.stderr[-4000:]
    assert "Traceback" not in smoke_run.stderr


def test_smoke_run_shows_no_tensorflow_start_up_notices(smoke_run):
    """TensorFlow 2.21 prints these from C++ at every start on a CPU machine, whatever TF_CPP_MIN_LOG_LEVEL says."""
    for notice in ("All log messages before absl::InitializeLog()", "oneDNN custom operations are on",
                   "Could not find cuda drivers", "failed call to cuInit"):
        assert notice not in smoke_run.stderr, smoke_run.stderr[-4000:]


def test_smoke_run_prints_device_count_matching_results(smoke_ok):
    match = re.search(r"^Number of devices: (\d+)$", smoke_ok.stdout, re.M)
    assert match, smoke_ok.stdout[-2000:]
    assert int(match.group(1)) == smoke_ok.results["replicas"]
    if SMOKE_CPU_REPLICAS:
        assert smoke_ok.results["replicas"] == SMOKE_CPU_REPLICAS


def test_smoke_run_prints_the_optimizer_learning_rate(smoke_ok):
    match = re.search(r"^Learning rate for epoch 1 is (0\.001\S*)$", smoke_ok.stdout, re.M)
    assert match, smoke_ok.stdout[-2000:]
    assert float(match.group(1)) == pytest.approx(1e-3, rel=1e-6)
    assert not re.search(r"^Learning rate for epoch 2 ", smoke_ok.stdout, re.M)  # one epoch only


def test_smoke_run_writes_checkpoint(smoke_ok):
    ckpt_dir = smoke_ok.path("training_checkpoints")
    assert os.path.isfile(os.path.join(ckpt_dir, "ckpt_1.index"))
    assert glob.glob(os.path.join(ckpt_dir, "ckpt_1.data-*-of-*"))
    assert os.path.isfile(os.path.join(ckpt_dir, "checkpoint"))
    latest = tf.train.latest_checkpoint(ckpt_dir)
    assert latest is not None and latest.endswith("ckpt_1")
    # The checkpoint holds the model's weights: each of its weights' shapes is there.
    shapes = list(dict(tf.train.list_variables(latest)).values())
    assert all(list(weight.shape) in shapes for weight in built_model().weights)


def _scalars(log_dir):
    """{tag: [values]} from every TensorBoard event file under log_dir."""
    found = {}
    files = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    number = tf.make_ndarray(value.tensor)
                    if number.ndim != 0 or number.dtype.kind not in "fiu":
                        continue
                    found.setdefault(value.tag, []).append(float(number))
                elif value.HasField("simple_value"):
                    found.setdefault(value.tag, []).append(value.simple_value)
    return files, found


def test_smoke_run_writes_tensorboard_scalars(smoke_ok):
    files, scalars = _scalars(smoke_ok.path("logs", "train"))
    assert files, "no TensorBoard event files under logs/"
    for tag in ("epoch_loss", "epoch_accuracy", "epoch_lr"):
        assert tag in scalars, sorted(scalars)
        assert len(scalars[tag]) == SMOKE_EPOCHS
    assert scalars["epoch_lr"][0] == pytest.approx(1e-3, rel=1e-6)
    assert 0.0 <= scalars["epoch_accuracy"][0] <= 1.0
    assert np.isfinite(scalars["epoch_loss"][0]) and scalars["epoch_loss"][0] > 0


def test_smoke_run_writes_saved_model(smoke_ok):
    saved = smoke_ok.path("saved_model")
    assert os.path.isfile(os.path.join(saved, "saved_model.pb"))
    assert os.path.isdir(os.path.join(saved, "variables"))
    # The export is moved into place; no half-written siblings stay behind, and the finished run's backup is gone.
    assert not os.path.exists(saved + ".partial")
    assert not os.path.exists(saved + ".old")
    assert not os.path.exists(smoke_ok.path("backup"))


def test_smoke_run_results_json(smoke_ok):
    results = smoke_ok.results
    for key in ("replicas", "epochs", "train_images_per_s", "eval_accuracy_checkpoint",
                "eval_accuracy_unreplicated", "eval_accuracy_replicated"):
        assert key in results, key
    assert results["epochs"] == SMOKE_EPOCHS
    assert results["replicas"] >= 1
    assert results["steps_per_epoch"] == SMOKE_STEPS
    assert results["train_images_per_s"] > 0
    # CPU seconds of `fit` (the scaling benchmark's images per CPU-second); no GPU here, so no GPU memory figure.
    assert 0 < results["train_cpu_seconds"] and results["peak_gpu_memory_mb"] is None
    # Each epoch's wall seconds (the benchmarks' split of a run): one per epoch, together within fit's time.
    epochs = results["train_epoch_seconds"]
    assert len(epochs) == SMOKE_EPOCHS and all(s > 0 for s in epochs)
    assert sum(epochs) <= results["train_seconds"] + 0.01
    acc = results["eval_accuracy_checkpoint"]
    assert results["eval_accuracy_unreplicated"] == acc
    assert results["eval_accuracy_replicated"] == acc
    assert 0.0 <= acc <= 1.0
    # results.json is also what the run printed, last before the summary for people.
    printed, end = json.JSONDecoder().raw_decode(smoke_ok.stdout, smoke_ok.stdout.rindex("\n{") + 1)
    assert printed == results
    assert smoke_ok.stdout[end:].lstrip().startswith("Summary")


def test_smoke_run_trains_the_tutorial_model_past_chance(smoke_ok):
    # The data is learnable (one bright block per class); 3 steps of the tutorial's model beat chance (0.1) by far.
    assert 0.5 < smoke_ok.results["eval_accuracy_checkpoint"] <= 1.0


def test_smoke_run_ends_with_a_summary_in_the_tutorials_step_order(smoke_ok):
    results = smoke_ok.results
    summary = smoke_ok.stdout[smoke_ok.stdout.rindex("Summary"):]
    lines = summary.strip().splitlines()
    assert len(lines) <= 9, summary
    assert re.findall(r"^  (\d)\. ", summary, re.M) == ["1", "2", "3", "4", "5", "6"]
    replicas = results["replicas"]
    assert f"{replicas} replica{'s' if replicas > 1 else ''} in sync" in lines[1]
    if SMOKE_CPU_REPLICAS:
        assert "CPU:0, CPU:1" in lines[1]
    assert f"{NUM_TRAIN:,} training and {NUM_TEST:,} test images" in lines[2]
    # The model the run built, named by where it comes from, whatever model.py builds.
    parameters = built_model().count_params()
    assert results["parameters"] == parameters
    assert f"build_model() of model.py, {parameters:,} parameters, compiled in the strategy's scope" in lines[3]
    assert f"of {SMOKE_EPOCHS} at {results['train_images_per_s']:,.0f} images/s, validated each epoch" in lines[4]
    accuracies = re.findall(r"test accuracy (\d\.\d{4})|(\d\.\d{4}) in the strategy's scope", summary)
    assert [float(a or b) for a, b in accuracies] == pytest.approx(
        [results["eval_accuracy_checkpoint"], results["eval_accuracy_unreplicated"], results["eval_accuracy_replicated"]],
        abs=5e-5)
    # Every output is named where it went, and is there.
    for name in ("logs", "training_checkpoints", "saved_model", "model.keras", "results.json"):
        assert smoke_ok.path(name) in summary, name
        assert os.path.exists(smoke_ok.path(name)), name


# ---------------------------------------------------------------- --validation: a validation run in TensorBoard

def _tensorboard_scalars(run_dir, tags):
    """{tag: [(step, value)]} from one TensorBoard run, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing import event_accumulator

    reader = event_accumulator.EventAccumulator(run_dir)
    reader.Reload()
    assert set(tags) <= set(reader.Tags()["tensors"]), reader.Tags()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in reader.Tensors(tag)] for tag in tags}


def test_validation_writes_a_validation_run_beside_train(smoke_ok, dataset_arrays):
    assert sorted(os.listdir(smoke_ok.path("logs"))) == ["train", "validation"]
    validation = _tensorboard_scalars(smoke_ok.path("logs", "validation"), ("epoch_loss", "epoch_accuracy"))
    for tag, points in validation.items():
        assert [step for step, _ in points] == list(range(SMOKE_EPOCHS)), (tag, points)
    # The last epoch's validation figures are the test split's, for the weights the last checkpoint holds.
    net = built_model()
    net.load_weights(tf.train.latest_checkpoint(smoke_ok.path("training_checkpoints"))).expect_partial()
    images, labels = dataset_arrays["test"]
    logits = net.predict(scaled(images, labels)[0], verbose=0)
    loss = float(model.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits))
    accuracy = float(np.mean(np.argmax(logits, axis=1) == labels))
    assert validation["epoch_loss"][-1][1] == pytest.approx(loss, abs=1e-5)
    assert validation["epoch_accuracy"][-1][1] == pytest.approx(accuracy, abs=1e-6)
    assert accuracy == pytest.approx(smoke_ok.results["eval_accuracy_checkpoint"], abs=1e-6)
    # The progress bar shows them too.
    assert re.search(r" - val_loss: \d+\.\d+ - val_accuracy: \d\.\d+", smoke_ok.stdout), smoke_ok.stdout[-2000:]


# ---------------------------------------------------------------- global batch

def test_global_batch_is_per_replica_times_replicas(smoke_ok):
    results = smoke_ok.results
    assert results["global_batch_size"] == SMOKE_BATCH * results["replicas"]
    assert results["train_images"] == SMOKE_STEPS * SMOKE_BATCH * results["replicas"] * SMOKE_EPOCHS


# ---------------------------------------------------------------- checkpoint vs SavedModel

@pytest.fixture(scope="module")
def test_images(dataset_arrays):
    images, labels = dataset_arrays["test"]
    images, labels = scaled(images[:24], labels[:24])
    return images.numpy(), labels.numpy()


@pytest.fixture(scope="module")
def checkpoint_predictions(smoke_ok, test_images):
    net = built_model()
    net.load_weights(tf.train.latest_checkpoint(smoke_ok.path("training_checkpoints"))).expect_partial()
    return net.predict(test_images[0], verbose=0)


def test_checkpoint_tutorial_model_is_trained(checkpoint_predictions, test_images):
    # Restored weights, not a fresh initialisation: the tutorial's model classifies the learnable test images.
    accuracy = np.mean(np.argmax(checkpoint_predictions, axis=1) == test_images[1])
    assert accuracy > 0.5


SERVE_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import tensorflow as tf
    root, saved, images_path, out_path = sys.argv[1:5]
    assert not any(os.path.exists(p) and os.path.samefile(p, root) for p in sys.path if p), sys.path
    for name in ("model", "export", "callbacks"):
        assert name not in sys.modules
    fn = tf.saved_model.load(saved).signatures["serving_default"]
    (input_name,) = fn.structured_input_signature[1].keys()
    outputs = fn(**{input_name: tf.constant(np.load(images_path))})
    (logits,) = outputs.values()
    np.save(out_path, logits.numpy())
""")


def _predict_in_fresh_process(script, model_path, images, tmp_path):
    """Logits from `script` run in a fresh process, outside the project's folder, on `images`."""
    images_path, out_path = tmp_path / "images.npy", tmp_path / "logits.npy"
    np.save(images_path, images)
    proc = subprocess.run([sys.executable, "-c", script, ROOT, model_path, str(images_path), str(out_path)],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out_path)


@pytest.mark.slow
def test_saved_model_serves_same_predictions_without_project_code(smoke_ok, test_images, checkpoint_predictions,
                                                                  tmp_path):
    served = _predict_in_fresh_process(SERVE_SCRIPT, smoke_ok.path("saved_model"), test_images[0], tmp_path)
    assert served.shape == checkpoint_predictions.shape == (len(test_images[0]), NUM_CLASSES)
    np.testing.assert_allclose(served, checkpoint_predictions, atol=1e-5, rtol=0)


KERAS3_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    root, path, images_path, out_path = sys.argv[1:5]
    assert not any(os.path.exists(p) and os.path.samefile(p, root) for p in sys.path if p), sys.path
    import keras
    assert keras.__version__.startswith("3."), keras.__version__
    net = keras.saving.load_model(path)
    np.save(out_path, net.predict(np.load(images_path), verbose=0))
    for name in ("tf_keras", "model", "export", "callbacks", "data"):
        assert name not in sys.modules, name
""")


@pytest.mark.slow
def test_model_keras_loads_in_keras_3_and_predicts_like_the_checkpoint(smoke_ok, test_images, checkpoint_predictions,
                                                                       tmp_path):
    # Written beside saved_model/, under a temporary name that does not stay behind.
    assert_only_documented_outputs(smoke_ok.output_dir)
    predicted = _predict_in_fresh_process(KERAS3_SCRIPT, smoke_ok.path("model.keras"), test_images[0], tmp_path)
    assert predicted.shape == checkpoint_predictions.shape == (len(test_images[0]), NUM_CLASSES)
    np.testing.assert_allclose(predicted, checkpoint_predictions, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_saved_model_cli_shows_serving_default(smoke_ok, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "show",
                           "--dir", smoke_ok.path("saved_model"), "--all"],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "serving_default" in proc.stdout


def test_export_reload_predicts_like_the_checkpoint(smoke_ok, test_images, checkpoint_predictions):
    reloaded = export.reload(smoke_ok.path("saved_model"))
    np.testing.assert_allclose(reloaded.predict(test_images[0], verbose=0), checkpoint_predictions,
                               atol=1e-5, rtol=0)
