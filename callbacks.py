"""Tutorial step 4's callbacks: TensorBoard, a weights checkpoint every epoch, the learning-rate
schedule, the printed learning rate; plus the backup that lets a killed or pre-empted run resume, and the
tutorial's advice for larger batches (scale the learning rate with the batch, warmed up per step)."""

import os

import tensorflow as tf

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


# ---------------------------------------------------------------- resume position and pre-emption

# The variables Keras's BackupAndRestore keeps in its checkpoint: the epoch it was in, and its last finished step.
SAVED_EPOCH = "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE"
SAVED_STEP = "ckpt_saved_batch/.ATTRIBUTES/VARIABLE_VALUE"


def backed_up_position(backup_dir, steps_per_epoch):
    """(epoch, step) where a run resumes from the backup in `backup_dir`: (0, 0) when there is none.

    The one place the position is computed; the input stream starts there, and Keras's `fit` reads the same
    two variables with the same rule (after an epoch's last step, the next epoch's first).
    """
    latest = tf.train.latest_checkpoint(os.path.join(backup_dir, "chief"))
    if latest is None:
        return 0, 0
    epoch, step = (int(tf.train.load_variable(latest, name)) for name in (SAVED_EPOCH, SAVED_STEP))
    return (epoch + 1, 0) if step >= steps_per_epoch - 1 else (epoch, step + 1)


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
    next step boundary after SIGTERM, then raising `Preempted`.

    Keras records the step an execution of `steps_per_execution` steps starts at, and resumes one step after
    it, which repeats the execution's other steps; this records the last step it finished instead.
    """

    def __init__(self, backup_dir, *, steps_per_epoch, every_steps=None, preemption=None):
        # An int save_freq is what makes Keras resume at a step rather than at an epoch; when to save is decided here.
        super().__init__(backup_dir, save_freq=every_steps or steps_per_epoch, delete_checkpoint=False)
        self._steps_per_epoch = steps_per_epoch
        self._every_steps = every_steps
        self._preemption = preemption or Preemption()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._preempted_anywhere = _any_worker(self.model.distribute_strategy)
        self._preemption.training = True

    def on_train_batch_begin(self, batch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the last step of the execution that just finished.
        preempted = self._preempted_anywhere(self._preemption.requested)
        if batch >= self._steps_per_epoch - 1:
            return  # the epoch's end backs up, after its checkpoint, and acts on a pre-emption
        due = self._every_steps and (batch + 1) % self._every_steps == 0
        if due or preempted:
            self._save(self._current_epoch, batch)
        if preempted:
            self._stop(self._current_epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch, self._steps_per_epoch - 1)
        if self._preempted_anywhere(self._preemption.requested):
            self._stop(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self._preemption.training = False
        super().on_train_end(logs)

    def _save(self, epoch, last_step):
        self._training_state._ckpt_saved_batch.assign(last_step)
        self._backup(epoch=epoch, batch=last_step)

    def _stop(self, epoch, step):
        self._preemption.training = False
        raise Preempted(f"pre-empted (SIGTERM); training state saved at epoch {epoch + 1}, step {step} "
                        f"(global step {epoch * self._steps_per_epoch + step}); run the same command again "
                        "to resume there")


def make_callbacks(cfg, *, log_dir, checkpoint_dir, backup_dir, steps_per_epoch, preemption=None):
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
        Backup(backup_dir, steps_per_epoch=steps_per_epoch, every_steps=cfg.backup_every_steps,
               preemption=preemption),
    ]
