"""What a multi-GPU box needs, run on CPUs: the scaled and warmed-up learning rate (arithmetic, across a resume,
through the whole entrypoint), mixed precision in float16 and bfloat16 (loss scaling or none, the bare flag's
meaning, float32 outputs and serving signature, the Keras 3 file), and the all-reduce choice recorded. The one-step comparison of the all-reduces is in test_multireplica.py."""

import os

import numpy as np
import pytest
import tensorflow as tf

import callbacks
import data
import config
import model
from machinery import resume
from config import Config
from runs import SMOKE_CPU_REPLICAS, finished, smoke_args
from small_data import scaled
from model import keras
from test_smoke_run import KERAS3_SCRIPT, _predict_in_fresh_process, _scalars

TUTORIAL = Config()


def expected_rate(step, *, steps_per_epoch, scale, warmup_epochs):
    """The rule as the README states it, written out independently of callbacks.ScaledDecay."""
    epoch = step // steps_per_epoch
    warmup_steps = warmup_epochs * steps_per_epoch
    factor = 1 + (scale - 1) * min(1, step / warmup_steps) if warmup_steps else scale
    return callbacks.decay(epoch, TUTORIAL.lr_boundaries, TUTORIAL.lr_values) * factor


# ---------------------------------------------------------------- the arithmetic

@pytest.mark.parametrize("per_replica, replicas, scale_lr, expected", [
    (64, 1, True, 1.0),     # the tutorial's own batch
    (64, 2, True, 2.0),     # 2 replicas of 64
    (128, 4, True, 8.0),    # 4 replicas of 128
    (128, 4, False, 1.0),   # off by default: the tutorial does not scale
])
def test_learning_rate_scale_is_global_batch_over_64(per_replica, replicas, scale_lr, expected):
    assert callbacks.learning_rate_scale(per_replica * replicas, scale_lr) == expected


def test_learning_rate_is_the_tutorials_unless_scaled():
    assert callbacks.learning_rate(Config(), global_batch=512, steps_per_epoch=10) is None


def test_scaled_decay_ramps_per_step_then_decays():
    steps = 10
    schedule = callbacks.ScaledDecay(TUTORIAL.lr_boundaries, TUTORIAL.lr_values, steps, scale=4.0, warmup_steps=2 * steps)
    by_hand = {
        0: 1e-3,                 # warm-up starts at the unscaled rate
        1: 1e-3 * (1 + 3 / 20),  # and moves every step, not every epoch
        10: 2.5e-3,              # halfway: 1 + 3 x 0.5
        19: 1e-3 * (1 + 3 * 19 / 20),
        20: 4e-3,                # epoch 2: fully scaled
        29: 4e-3,
        30: 4e-4,                # epoch 3: the tutorial's 1e-4, scaled
        69: 4e-4,
        70: 4e-5,                # epoch 7 on: 1e-5, scaled
        119: 4e-5,
    }
    for step, rate in by_hand.items():
        assert float(schedule(step)) == pytest.approx(rate, rel=1e-6), step
        assert float(schedule(step)) == pytest.approx(
            expected_rate(step, steps_per_epoch=steps, scale=4.0, warmup_epochs=2), rel=1e-6), step


def test_scaled_decay_at_scale_one_is_the_tutorials_schedule_at_every_step():
    steps = 7
    schedule = callbacks.ScaledDecay(TUTORIAL.lr_boundaries, TUTORIAL.lr_values, steps, scale=1.0, warmup_steps=0)
    for step in range(12 * steps):
        assert float(schedule(step)) == pytest.approx(
            callbacks.decay(step // steps, TUTORIAL.lr_boundaries, TUTORIAL.lr_values), rel=1e-6), step


def test_scaled_decay_without_warmup_starts_scaled():
    schedule = callbacks.ScaledDecay(TUTORIAL.lr_boundaries, TUTORIAL.lr_values, 10, scale=8.0, warmup_steps=0)
    assert float(schedule(0)) == pytest.approx(8e-3, rel=1e-6)
    assert float(schedule(30)) == pytest.approx(8e-4, rel=1e-6)


# ---------------------------------------------------------------- warm-up across a resume

STEPS = 5
GLOBAL_BATCH = 128  # twice the tutorial's: --scale-lr doubles every rate
WARMUP = Config(scale_lr=True, warmup_epochs=2, epochs=4)
IMAGE_SHAPE, NUM_CLASSES = data.image_shape_and_classes()  # from tfds's DatasetInfo


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(3)
    x = rng.random((STEPS * GLOBAL_BATCH, *IMAGE_SHAPE), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, len(x))
    # The same STEPS batches every epoch, so a resumed epoch sees what the uninterrupted one saw.
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()


def first_layer(net):
    """The model's first layer with weights: a functional model's layers begin with its Input, which computes
    nothing."""
    return next(layer for layer in net.layers if layer.weights)


@pytest.fixture(scope="module")
def initial_weights():
    keras.utils.set_random_seed(5)
    return model.build_model(IMAGE_SHAPE, NUM_CLASSES).get_weights()


def _train(batches, initial, output_dir, *, epochs, steps_per_execution):
    """The project's own compile and callbacks (BackupAndRestore included) on a fresh model and optimizer,
    from the position in the backup, as the entrypoint starts."""
    net = model.build_model(IMAGE_SHAPE, NUM_CLASSES)
    net.set_weights(initial)
    settings = resume.Settings.of(WARMUP, num_examples=STEPS * GLOBAL_BATCH, global_batch=GLOBAL_BATCH)
    plan = resume.start(str(output_dir / "backup"), settings, epochs=epochs, overwrite=False)
    rate = callbacks.learning_rate(WARMUP, global_batch=GLOBAL_BATCH, steps_per_epoch=STEPS,
                                   step_offset=plan.step_offset)
    model.compile_model(net, steps_per_execution=steps_per_execution, fused_adam=WARMUP.fused_adam, learning_rate=rate)
    cbs = callbacks.make_callbacks(WARMUP, log_dir=str(output_dir / "logs"), checkpoint_dir=str(output_dir / "ckpt"),
                                   backup_dir=str(output_dir / "backup"), plan=plan)
    history = net.fit(batches, epochs=epochs, initial_epoch=plan.epoch, steps_per_epoch=STEPS, callbacks=cbs,
                      verbose=0)
    return net, history


@pytest.mark.slow
def test_warmup_continues_across_a_resume(batches, initial_weights, tmp_path, capsys):
    expected = [expected_rate((epoch + 1) * STEPS - 1, steps_per_epoch=STEPS, scale=2.0, warmup_epochs=2)
                for epoch in range(WARMUP.epochs)]
    assert expected[0] < expected[1] < expected[2] == 2e-3  # the ramp, then the scaled rate

    whole, history = _train(batches, initial_weights, tmp_path / "whole", epochs=WARMUP.epochs, steps_per_execution=50)
    assert history.history["lr"] == pytest.approx(expected, rel=1e-6)

    # Stopped after epoch 1, in the middle of the warm-up, and started again on a fresh model and optimizer:
    # BackupAndRestore restores the weights, the optimizer and its step count, and the ramp carries on.
    _train(batches, initial_weights, tmp_path / "resumed", epochs=1, steps_per_execution=50)
    capsys.readouterr()
    resumed, history = _train(batches, initial_weights, tmp_path / "resumed", epochs=WARMUP.epochs, steps_per_execution=50)
    assert history.epoch == [1, 2, 3]
    assert history.history["lr"] == pytest.approx(expected[1:], rel=1e-6)
    printed = [float(line.rsplit(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("Learning rate for epoch")]
    assert printed == pytest.approx(expected[1:], rel=1e-6)
    for got, want in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    # The rate changes at every step inside one call of 50 steps: one step per call trains the same weights.
    stepwise, _ = _train(batches, initial_weights, tmp_path / "stepwise", epochs=WARMUP.epochs, steps_per_execution=1)
    for got, want in zip(stepwise.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("flags, policy", [
    ([], "float32"),
    (["--mixed-precision"], "mixed_float16"),  # the bare flag, as before it took a value
    (["--mixed-precision", "float16"], "mixed_float16"),
    (["--mixed-precision", "bfloat16"], "mixed_bfloat16"),
    (["--mixed-precision", "bfloat16", "--no-mixed-precision"], "float32"),
    (["--mixed-precision", "--epochs", "3"], "mixed_float16"),  # the next flag is not taken for its value
])
def test_the_bare_mixed_precision_flag_still_means_float16(flags, policy):
    parser = config.build_parser("train_mnist_mirrored.py", "")
    assert config.validate(config.from_args(parser.parse_args(flags))).dtype_policy == policy


def test_mixed_precision_scales_the_loss_around_the_fused_adam(batches):
    try:
        model.use_mixed_precision("mixed_float16")
        net = model.build_model(IMAGE_SHAPE, NUM_CLASSES)
        schedule = callbacks.ScaledDecay(TUTORIAL.lr_boundaries, TUTORIAL.lr_values, STEPS, scale=2.0, warmup_steps=0)
        model.compile_model(net, fused_adam=True, learning_rate=schedule)
        net.fit(batches, epochs=1, steps_per_epoch=2, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # compile wrapped the project's default optimizer, legacy (fused) Adam, in dynamic loss scaling...
    assert isinstance(net.optimizer, keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(net.optimizer.inner_optimizer, keras.optimizers.legacy.Adam)
    assert net.optimizer.dynamic and np.isfinite(float(net.optimizer.loss_scale))
    # ...float16 compute, float32 logits...
    assert first_layer(net).compute_dtype == "float16" and first_layer(net).variable_dtype == "float32"
    assert net.layers[-1].compute_dtype == "float32" and net.output.dtype == tf.float32
    # ...and the learning rate is still read through the wrapper.
    assert int(net.optimizer.iterations) == 2
    assert callbacks.applied_learning_rate(net.optimizer) == pytest.approx(2e-3, rel=1e-6)


def test_bfloat16_computes_in_bfloat16_and_scales_no_loss(batches):
    try:
        model.use_mixed_precision("mixed_bfloat16")
        net = model.compile_model(model.build_model(IMAGE_SHAPE, NUM_CLASSES), fused_adam=True)
        net.fit(batches, epochs=1, steps_per_epoch=2, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # bfloat16 has float32's exponent range: the fused Adam is not wrapped, and updates float32 weights...
    assert isinstance(net.optimizer, keras.optimizers.legacy.Adam) and int(net.optimizer.iterations) == 2
    assert all(weight.dtype == tf.float32 for weight in net.weights)
    # ...from bfloat16 compute, with float32 logits.
    assert first_layer(net).compute_dtype == "bfloat16" and net.layers[-1].compute_dtype == "float32"
    assert net.output.dtype == tf.float32


# ---------------------------------------------------------------- the whole entrypoint, every option at once

RUN_EPOCHS = 2
RUN_STEPS = 3
RUN_BATCH = 64


def finished_run(tmp_path_factory, data_dir, name, options):
    """A smoke run with `options`, to its end (runs.finished): its output folder, stdout and results.json."""
    output_dir = str(tmp_path_factory.mktemp(name) / "out")
    return finished([*smoke_args(data_dir, output_dir), *options], tmp_path_factory.mktemp(f"{name}_process"))


@pytest.fixture(scope="module")
def options_run(tmp_path_factory, data_dir):
    options = ["--epochs", str(RUN_EPOCHS), "--steps-per-epoch", str(RUN_STEPS), "--batch-size-per-replica",
               str(RUN_BATCH), "--scale-lr", "--warmup-epochs", "1", "--mixed-precision", "--gpu-memory-growth"]
    if SMOKE_CPU_REPLICAS:
        options += ["--cpu-replicas", str(SMOKE_CPU_REPLICAS), "--cross-device-ops", "hierarchical-copy"]
    return finished_run(tmp_path_factory, data_dir, "options", options)


@pytest.mark.slow
def test_options_run_records_its_choices(options_run):
    _, _, results = options_run
    assert results["global_batch_size"] == RUN_BATCH * results["replicas"]
    assert results["learning_rate_scale"] == results["global_batch_size"] / 64
    assert results["warmup_epochs"] == 1
    assert results["dtype_policy"] == "mixed_float16" and results["gpu_memory_growth"] is True  # the bare flag
    assert results["cross_device_ops"] == ("hierarchical-copy" if SMOKE_CPU_REPLICAS else "default")
    assert results["communication"] == "default"
    assert results["eval_accuracy_checkpoint"] == results["eval_accuracy_unreplicated"] == results["eval_accuracy_replicated"]


@pytest.mark.slow
def test_options_run_prints_and_logs_the_rate_really_used(options_run):
    output_dir, stdout, results = options_run
    scale = results["learning_rate_scale"]
    expected = [expected_rate((epoch + 1) * RUN_STEPS - 1, steps_per_epoch=RUN_STEPS, scale=scale, warmup_epochs=1)
                for epoch in range(RUN_EPOCHS)]
    assert expected[0] != expected[1]  # mid-ramp, then scaled
    printed = [float(line.rsplit(" ", 1)[1]) for line in stdout.splitlines()
               if line.startswith("Learning rate for epoch")]
    assert printed == pytest.approx(expected, rel=1e-6)
    _, scalars = _scalars(os.path.join(output_dir, "logs"))
    assert scalars["epoch_lr"] == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def bfloat16_run(tmp_path_factory, data_dir):
    return finished_run(tmp_path_factory, data_dir, "bfloat16", ["--mixed-precision", "bfloat16"])


@pytest.mark.slow
def test_a_bfloat16_run_runs_to_the_end_and_names_its_policy(bfloat16_run):
    _, stdout, results = bfloat16_run  # runs.finished saw no traceback
    assert results["dtype_policy"] == "mixed_bfloat16"
    assert results["eval_accuracy_checkpoint"] == results["eval_accuracy_unreplicated"] > 0.5
    assert "compiled in the strategy's scope, mixed_bfloat16" in stdout  # the summary names it


@pytest.mark.slow
@pytest.mark.parametrize("run, compute", [("options_run", "float16"), ("bfloat16_run", "bfloat16")])
def test_mixed_precision_exports_serve_float32(run, compute, request, dataset_arrays, tmp_path):
    output_dir, _, _ = request.getfixturevalue(run)
    saved = os.path.join(output_dir, "saved_model")
    serve = tf.saved_model.load(saved).signatures["serving_default"]
    (spec,) = serve.structured_input_signature[1].values()
    assert spec.dtype == tf.float32
    (out_spec,) = serve.structured_outputs.values()
    assert out_spec.dtype == tf.float32
    images = scaled(*(part[:8] for part in dataset_arrays["test"]))[0].numpy()
    (logits,) = serve(**{next(iter(serve.structured_input_signature[1])): tf.constant(images)}).values()
    assert logits.dtype == tf.float32 and logits.shape == (8, NUM_CLASSES) and np.all(np.isfinite(logits.numpy()))
    # It was trained and exported in mixed precision: float16 or bfloat16 compute inside, float32 at the end.
    reloaded = keras.models.load_model(saved, compile=False)
    assert first_layer(reloaded).dtype_policy.name == f"mixed_{compute}"
    assert reloaded.layers[-1].dtype_policy.name == "float32"
    # Keras 3 loads the Keras file, policies and all, and its float32 logits are the SavedModel's.
    predicted = _predict_in_fresh_process(KERAS3_SCRIPT, os.path.join(output_dir, "model.keras"), images, tmp_path)
    assert predicted.dtype == np.float32
    np.testing.assert_allclose(predicted, logits.numpy(), atol=1e-5, rtol=0)
