"""Tutorial step 4's callbacks: TensorBoard, a weights checkpoint every epoch, the learning-rate
schedule, the printed learning rate; plus the backup that lets a killed or pre-empted run resume, and the
tutorial's advice for larger batches (scale the learning rate with the batch, warmed up per step)."""

import os
import time

import numpy as np
import tensorflow as tf

import resume
import tf_private
from config import Preempted
from model import keras
from sigterm import Preemption

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


# ---------------------------------------------------------------- pre-emption and the backup

def _any_worker(strategy):
    """A function telling whether any worker's flag is up: an all-reduce, so all workers stop at one step."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return lambda flag: flag

    @tf.function
    def combine(flag):
        def on_replica():
            # Made inside the replica function, so that it is placed on the replica's device. ReduceOp has no
            # MAX; a sum above zero says the same.
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(flag, tf.float32))

        return strategy.experimental_local_results(strategy.run(on_replica))[0]

    return lambda flag: bool(combine(tf.constant(int(flag))).numpy() > 0)


class Backup(keras.callbacks.BackupAndRestore):
    """Keras's BackupAndRestore, backing up at each epoch's end, every `every_steps` steps if given, and at the
    next step boundary after SIGTERM, then raising `Preempted`; each backup also records its position in
    images and what that means (resume.py), in the same checkpoint.

    Keras records the step an execution of `steps_per_execution` steps starts at, and resumes one step after
    it, which repeats the execution's other steps; this records the last step it finished instead. Keras keeps
    one checkpoint and restores it whatever its state; this keeps two and restores the one resume.start found
    whole (docs/faults.md, "A damaged backup").
    """

    def __init__(self, backup_dir, *, plan, every_steps=None, preemption=None):
        # An int save_freq is what makes Keras resume at a step rather than at an epoch; when to save is decided here.
        super().__init__(backup_dir, save_freq=every_steps or plan.steps, delete_checkpoint=False)
        self._plan = plan
        self._every_steps = every_steps
        self._preemption = preemption or Preemption()
        # Made here, outside the strategy's scope (fit calls on_train_begin inside it): one plain variable.
        self._record = tf.Variable("", trainable=False, name=resume.RECORD)

    def on_train_begin(self, logs=None):
        # Keras's own on_train_begin, but for two things: its training state keeps BACKUPS_KEPT checkpoints, not
        # one, and it restores the one resume.start chose and read the position from (plan.checkpoint, the newest
        # that reads back whole), where Keras would restore the newest whatever its state. Every worker restores
        # from the chief's folder, as Keras's own does.
        tf_private.build_optimizer(self.model)  # as Keras does, so that the restore fills its slots
        state = tf_private.worker_training_state(self.model, self.backup_dir, self.save_freq)
        tf_private.attach_training_state(self, state)
        if state.write_checkpoint_manager is state.read_checkpoint_manager:  # the chief, which writes where all read
            state.write_checkpoint_manager = state.read_checkpoint_manager = tf.train.CheckpointManager(
                state.read_checkpoint_manager.checkpoint, state.read_checkpoint_manager.directory,
                max_to_keep=resume.BACKUPS_KEPT)
        if self._plan.checkpoint:
            # The model, the optimizer and Keras's counters.
            state.read_checkpoint_manager.checkpoint.restore(self._plan.checkpoint)
        # Written with every backup from now on, in the same checkpoint as the weights.
        setattr(state.write_checkpoint_manager.checkpoint, resume.RECORD, self._record)
        # Keras's counters, in this run's steps: `fit` resumes epoch `plan.epoch` after the step before
        # `plan.first_step`; -1 (no step done) keeps the initial_epoch `fit` was given, at step 0.
        tf_private.set_saved_position(state, epoch=self._plan.epoch, batch=self._plan.first_step - 1)
        self._preempted_anywhere = _any_worker(self.model.distribute_strategy)
        self._preemption.start_training()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._last_step = (self._plan.first_step if epoch == self._plan.epoch else 0) - 1

    def on_train_batch_begin(self, batch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the last step of the execution that just finished.
        preempted = self._preempted_anywhere(self._preemption.requested)
        before, self._last_step = self._last_step, batch
        if batch >= self._plan.steps - 1:
            return  # the epoch's end backs up, after its checkpoint, and acts on a pre-emption
        # Due when the execution passed a multiple of every_steps: a resumed epoch's steps need not start at one.
        due = self._every_steps and (batch + 1) // self._every_steps > (before + 1) // self._every_steps
        if due or preempted:
            position = self._save(tf_private.current_epoch(self), batch)
            if preempted:
                self._stop(position)

    def on_epoch_end(self, epoch, logs=None):
        position = self._save(epoch, self._plan.steps - 1)
        if self._preempted_anywhere(self._preemption.requested):
            self._stop(position)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._preemption.end_training()  # raises Preempted for a SIGTERM after the last epoch's backup

    def _save(self, epoch, last_step):
        position = self._plan.position(epoch, last_step, int(self.model.optimizer.iterations.numpy()))
        self._record.assign(position.to_json())
        tf_private.set_saved_position(tf_private.training_state(self), batch=last_step)
        tf_private.back_up(self, epoch=epoch, batch=last_step)
        return position

    def _stop(self, position):
        # Training stays marked as on, so that a second SIGTERM only notes itself while the run leaves.
        raise Preempted(f"pre-empted (SIGTERM); training state saved at epoch {position.epoch + 1}, image "
                        f"{position.image:,} of {self._plan.epoch_images:,}; run the same command again to resume "
                        "there (on any number of replicas or workers)")


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
