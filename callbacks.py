"""Tutorial step 4's callbacks: TensorBoard, a weights checkpoint every epoch, the learning-rate
schedule, the printed learning rate; plus the backup that lets a killed run resume, and the tutorial's
advice for larger batches (scale the learning rate with the batch, warmed up per step)."""

import os

import tensorflow as tf

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
    the decay where they were.
    """

    def __init__(self, boundaries, values, steps_per_epoch, scale, warmup_steps):
        super().__init__()
        self.boundaries, self.values = tuple(boundaries), tuple(values)
        self.steps_per_epoch, self.scale, self.warmup_steps = steps_per_epoch, scale, warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
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
                "scale": self.scale, "warmup_steps": self.warmup_steps}


def learning_rate(cfg, *, global_batch, steps_per_epoch):
    """The optimizer's learning rate: None keeps the tutorial's (Adam's default, then LearningRateScheduler)."""
    if not cfg.scale_lr:
        return None
    return ScaledDecay(cfg.lr_boundaries, cfg.lr_values, steps_per_epoch,
                       scale=learning_rate_scale(global_batch, cfg.scale_lr),
                       warmup_steps=cfg.warmup_epochs * steps_per_epoch)


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
        print(f"\nLearning rate for epoch {epoch + 1} is {applied_learning_rate(self.model.optimizer)}")


class LogLR(keras.callbacks.Callback):
    """Adds the `lr` that LearningRateScheduler would add (TensorBoard's `epoch_lr`) when a schedule of
    steps sets the rate instead: the rate of the epoch's last step."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = applied_learning_rate(self.model.optimizer)


def make_callbacks(cfg, *, log_dir, checkpoint_dir, backup_dir):
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
        # model, the optimizer and the epoch at train begin; the program, not Keras, deletes the backup
        # once the whole run (export included) has finished, so a kill during export resumes there too.
        keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False),
    ]


def backed_up_epoch(backup_dir):
    """The epoch a BackupAndRestore backup will resume at (0 when there is none)."""
    latest = tf.train.latest_checkpoint(os.path.join(backup_dir, "chief"))
    if latest is None:
        return 0
    # BackupAndRestore records the last finished epoch under this key.
    return int(tf.train.load_variable(latest, "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE")) + 1
