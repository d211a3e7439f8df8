"""Tutorial step 4's callbacks: TensorBoard, a weights checkpoint every epoch, the learning-rate
schedule, the printed learning rate; plus the backup that lets a killed run resume."""

import os

import tensorflow as tf

from model import keras


def decay(epoch, boundaries, values):
    """The tutorial's schedule: values[0] before boundaries[0], values[1] before boundaries[1], ..."""
    for boundary, value in zip(boundaries, values):
        if epoch < boundary:
            return value
    return values[len(boundaries)]


class PrintLR(keras.callbacks.Callback):
    """Prints the learning rate the optimizer really holds at each epoch's end, not the schedule's value."""

    def on_epoch_end(self, epoch, logs=None):
        # TF 2.0's `model.optimizer.lr` is `learning_rate` in current Keras.
        rate = float(self.model.optimizer.learning_rate.numpy())
        print(f"\nLearning rate for epoch {epoch + 1} is {rate}")


def make_callbacks(cfg, *, log_dir, checkpoint_dir, backup_dir):
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
