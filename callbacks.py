"""Tutorial step 4's callbacks: TensorBoard, a weights checkpoint every epoch, the learning-rate
schedule, the printed learning rate, and the tutorial's advice for larger batches (scale the learning rate with
the batch, warmed up per step); beside them the backup that lets a killed or pre-empted run resume: Keras's
BackupAndRestore, driven by the resume plan (machinery/resume.py)."""

import os
import time

import numpy as np
import tensorboard.summary.v2  # noqa: F401  (tf.summary.scalar imports it at its first call, the first step's end)
import tensorflow as tf

from machinery import resume
from model import keras

# The global batch the tutorial's learning rates were chosen for: one replica of 64.
TUTORIAL_GLOBAL_BATCH = 64


def decay(epoch, boundaries, values):
    """The tutorial's schedule: values[0] before boundaries[0], values[1] before boundaries[1], ..."""
    for boundary, value in zip(boundaries, values):
        if epoch < boundary:
            return value
    return values[len(boundaries)]


def learning_rate_scale(global_batch, scale_lr):
    """The linear scaling rule (Goyal et al. 2017): k times the tutorial's batch, k times its learning rate."""
    return global_batch / TUTORIAL_GLOBAL_BATCH if scale_lr else 1.0


class ScaledDecay(keras.optimizers.schedules.LearningRateSchedule):
    """The tutorial's decay with every rate times `scale`, ramped linearly from 1x to `scale` over the
    first `warmup_steps` steps (Goyal et al. 2017; Horovod's Keras example).

    A function of the optimizer's step count, evaluated inside the train step: it changes every step even
    when `steps_per_execution` runs 50 steps per call (a callback would only change it between calls), and
    BackupAndRestore restores the step count with the optimizer, so a resumed run carries on the ramp and
    the decay where they were. The epoch is counted in this run's own steps, `step_offset` from the
    optimizer's: after a restart at another global batch the optimizer's count includes steps of another
    size (resume.Plan.step_offset), and the decay must still change at epoch boundaries.
    """

    def __init__(self, boundaries, values, steps_per_epoch, scale, warmup_steps, step_offset=0):
        super().__init__()
        self.boundaries, self.values = tuple(boundaries), tuple(values)
        self.steps_per_epoch, self.scale, self.warmup_steps = steps_per_epoch, scale, warmup_steps
        self.step_offset = step_offset

    def __call__(self, step):
        step = tf.cast(step + self.step_offset, tf.float32)
        epoch = tf.floor(step / self.steps_per_epoch)
        # decay(), in the graph: the value after as many boundaries as this epoch has passed.
        passed = tf.reduce_sum(tf.cast(epoch >= tf.constant(self.boundaries, tf.float32), tf.int32))
        rate = tf.gather(tf.constant(self.values, tf.float32), passed)
        if self.warmup_steps:
            done = tf.minimum(1.0, step / self.warmup_steps)
            return rate * (1.0 + (self.scale - 1.0) * done)
        return rate * self.scale

    def get_config(self):
        return {"boundaries": self.boundaries, "values": self.values, "steps_per_epoch": self.steps_per_epoch,
                "scale": self.scale, "warmup_steps": self.warmup_steps, "step_offset": self.step_offset}


def learning_rate(cfg, *, global_batch, steps_per_epoch, step_offset=0):
    """The optimizer's learning rate: None keeps the tutorial's (Adam's default, then LearningRateScheduler)."""
    if not cfg.scale_lr:
        return None
    return ScaledDecay(cfg.lr_boundaries, cfg.lr_values, steps_per_epoch,
                       scale=learning_rate_scale(global_batch, cfg.scale_lr),
                       warmup_steps=cfg.warmup_epochs * steps_per_epoch, step_offset=step_offset)


def applied_learning_rate(optimizer):
    """The rate the optimizer applied at its last step, whether it holds a value or a schedule of steps."""
    # TF 2.0's `model.optimizer.lr` is `learning_rate` in current Keras; a loss-scale wrapper passes it through.
    rate = optimizer.learning_rate
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(optimizer.iterations - 1)
    return float(rate.numpy())


class PrintLR(keras.callbacks.Callback):
    """Prints the learning rate the optimizer really applied at each epoch's end, not the schedule's value."""

    def on_epoch_end(self, epoch, logs=None):
        # As the float32 it is, shortest form first: 0.001, not its float64 expansion 0.0010000000474974513.
        rate = np.float32(applied_learning_rate(self.model.optimizer))
        print(f"\nLearning rate for epoch {epoch + 1} is {rate!s}")


class LogLR(keras.callbacks.Callback):
    """Adds the `lr` that LearningRateScheduler would add (TensorBoard's `epoch_lr`) when a schedule of
    steps sets the rate instead: the rate of the epoch's last step."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = applied_learning_rate(self.model.optimizer)


class EpochClock(keras.callbacks.Callback):
    """Each epoch's wall seconds, from the end of the one before (the first's from the clock's making, just
    before `fit`, so it holds the tracing); last among the callbacks, so each epoch holds their work too."""

    def __init__(self):
        super().__init__()
        self.ends = [time.perf_counter()]

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(time.perf_counter())

    def epoch_seconds(self):
        return [round(end - start, 3) for start, end in zip(self.ends, self.ends[1:])]


class Backup(resume.PositionedBackup, keras.callbacks.BackupAndRestore):
    """Keras's BackupAndRestore, backing up where the resume plan says and recording the position in images."""


def make_callbacks(cfg, *, log_dir, checkpoint_dir, backup_dir, plan, preemption=None):
    if cfg.scale_lr:
        schedule = LogLR()  # the optimizer's ScaledDecay sets the rate (learning_rate() above)
    else:
        schedule = keras.callbacks.LearningRateScheduler(lambda epoch: decay(epoch, cfg.lr_boundaries, cfg.lr_values))
    return [
        # Before TensorBoard, which writes the `lr` this one adds to each epoch's logs.
        schedule,
        keras.callbacks.TensorBoard(log_dir=log_dir),
        keras.callbacks.ModelCheckpoint(
            filepath=os.path.join(checkpoint_dir, cfg.checkpoint_name), save_weights_only=True),
        PrintLR(),
        # Last, so that an epoch counts as backed up only once its checkpoint is written. It restores the
        # model, the optimizer and the position at train begin; the program, not Keras, deletes the backup
        # once the whole run (export included) has finished, so a kill during export resumes there too.
        Backup(backup_dir, plan=plan, every_steps=cfg.backup_every_steps, preemption=preemption),
    ]
