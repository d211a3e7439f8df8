"""Where a run resumes, counted in images, and what its backup's position means.

A pre-empted job often comes back on another allocation: more or fewer replicas or workers, or another
--batch-size-per-replica, so another global batch and another number of steps an epoch. Keras's own
counters in the backup (the epoch, the last finished step) are steps of the old global batch, so the
position is kept in images instead: the epoch, and how many images of that epoch's seeded order are
trained. Beside it the backup records what gives those images their meaning: the training split's size,
the seed and shuffle buffer that order each epoch, the epoch's length and the learning-rate settings. A
restart whose settings would give the position another meaning is refused, before anything is written.

The record is a string variable in Keras's own backup checkpoint, not a file beside it: TensorFlow's
checkpoint manager commits a checkpoint by rewriting its small `checkpoint` index once the checkpoint's
files are complete, so the record and the weights it describes are committed together, and a kill at any
moment leaves the previous pair. A file written after the checkpoint could describe the one before it.

This is the one place the position is computed. The input stream starts at its image
(Plan.stream), `fit` at its step (Backup, below, sets Keras's counters), the learning-rate
schedule counts epochs from it (callbacks.ScaledDecay), and results.json reports it.
"""

import dataclasses
import json
import math
import os
import shutil
import sys
import typing

import tensorflow as tf

from machinery import input_engine, tf_private
from machinery.exits import Preempted, UsageError
from machinery.sigterm import Preemption

# The name the record has in the backup's checkpoint, and where Keras's BackupAndRestore keeps the chief's backup.
RECORD = "resume_position"
CHIEF_BACKUP = "chief"
# Checkpoints the backup keeps (Keras keeps one): should the newest be damaged, say truncated when the storage
# under it failed, a restart goes on from the one before it (newest_intact). Each is the size of the model
# and its optimizer's state.
BACKUPS_KEPT = 2
START_OVER = "or add --overwrite to start over"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a position means: the settings that decide each epoch's images and order, the global batch it
    was trained at, and the learning-rate schedule along it."""

    num_examples: int
    seed: int
    buffer_size: int
    steps_per_epoch: typing.Optional[int]  # the flag: None trains whole epochs
    global_batch: int
    scale_lr: bool
    warmup_epochs: int

    @classmethod
    def of(cls, cfg, *, num_examples, global_batch):
        return cls(num_examples=num_examples, seed=cfg.seed, buffer_size=cfg.buffer_size,
                   steps_per_epoch=cfg.steps_per_epoch, global_batch=global_batch, scale_lr=cfg.scale_lr,
                   warmup_epochs=cfg.warmup_epochs)

    @property
    def steps(self):
        """Steps an epoch: the last one holds what is left of the epoch's images, so it may be short."""
        return input_engine.steps_per_epoch(self.num_examples, self.global_batch, self.steps_per_epoch)

    @property
    def epoch_images(self):
        """Images an epoch trains: the whole split, or the first steps x global batch of its order."""
        return input_engine.images_per_epoch(self.steps, self.global_batch, self.num_examples)


@dataclasses.dataclass(frozen=True)
class Position:
    """A backed-up position: `image` images of epoch `epoch`'s order are trained (0 after a whole epoch, with
    `epoch` the next one), the optimizer had taken `optimizer_step` steps, under `settings`."""

    epoch: int
    image: int
    optimizer_step: int
    settings: Settings

    def to_json(self):
        return json.dumps({"epoch": self.epoch, "image": self.image, "optimizer_step": self.optimizer_step,
                           **dataclasses.asdict(self.settings)}, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        fields = json.loads(text)
        settings = Settings(**{f.name: fields[f.name] for f in dataclasses.fields(Settings)})
        return cls(epoch=fields["epoch"], image=fields["image"], optimizer_step=fields["optimizer_step"],
                   settings=settings)


def damage(path):
    """What is wrong with the checkpoint at `path`, or None when every tensor in it reads back whole.

    TensorFlow's reader checks each tensor's length and checksum (CRC32C) as it reads it, so reading them all is
    the check, the size of the model and its optimizer's state: a truncated file reads short (IndexError), a changed byte fails its checksum, a
    missing file is not found, a damaged index is not an sstable.
    """
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, IndexError, ValueError) as err:
        return f"{os.path.basename(path)}: {str(err).splitlines()[0]}"
    return None


def newest_intact(backup_dir):
    """The newest checkpoint of the backup in `backup_dir` that reads back whole (None without a backup), and what
    is wrong with each newer one; UsageError, with nothing touched, when there is a backup and none of it is whole."""
    state = tf.train.get_checkpoint_state(os.path.join(backup_dir, CHIEF_BACKUP))
    if state is None:
        return None, []
    damaged = []
    for path in reversed(state.all_model_checkpoint_paths or [state.model_checkpoint_path]):
        problem = damage(path)
        if problem is None:
            return path, damaged
        damaged.append(problem)
    raise UsageError(f"the backup in {backup_dir} is damaged, none of its checkpoints reads back whole "
                     f"({'; '.join(damaged)}); it is left as it was: put back an intact copy to resume, "
                     f"{START_OVER}")


def position_in(checkpoint, backup_dir):
    """The position the backup's checkpoint `checkpoint` records."""
    record = tf_private.backed_up_value(checkpoint, RECORD)
    if record is None:
        raise UsageError(f"the backup in {backup_dir} does not record what its position means (an earlier version "
                         f"of this script made it); finish it with that version, {START_OVER}")
    return Position.from_json(record.decode())


def read(backup_dir):
    """The position the newest intact checkpoint of the backup in `backup_dir` holds; None when there is no backup."""
    checkpoint, _ = newest_intact(backup_dir)
    return None if checkpoint is None else position_in(checkpoint, backup_dir)


# ---------------------------------------------------------------- what a restart may change

# The settings a restart must keep, each with why: the image order, the epoch's length, the schedule.
KEPT = {
    "seed": "it seeds each epoch's image order",
    "buffer_size": "it shapes each epoch's image order",
    "steps_per_epoch": "it sets an epoch's length",
    "scale_lr": "it sets the learning-rate schedule",
    "warmup_epochs": "it sets the learning-rate schedule",
}


def _with(name, value):
    """A setting as the command line gives it: `with --seed 7`, `without --scale-lr`."""
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return f"without {flag}"
    return f"with {flag}" if value is True else f"with {flag} {value}"


def check(position, now, *, epochs, backup_dir):
    """Raises UsageError, one line naming the setting, the backup's value and the way out, when `now` (this
    run's Settings) or `epochs` would give the backed-up position another meaning."""
    then = position.settings
    if now.num_examples != then.num_examples:
        raise UsageError(f"the training split in --data-dir has {now.num_examples:,} images, but the backup in "
                         f"{backup_dir} was made on one of {then.num_examples:,}; rerun with that --data-dir to "
                         f"resume it, {START_OVER}")
    for name, why in KEPT.items():
        if getattr(now, name) != getattr(then, name):
            raise UsageError(f"the backup in {backup_dir} was made {_with(name, getattr(then, name))} ({why}), "
                             f"this run is {_with(name, getattr(now, name))}; rerun {_with(name, getattr(then, name))} "
                             f"to resume it, {START_OVER}")
    if now.epoch_images != then.epoch_images:
        # Only --steps-per-epoch makes an epoch's length depend on the global batch.
        raise UsageError(f"the backup in {backup_dir} trained epochs of {then.epoch_images:,} images (--steps-per-epoch "
                         f"{then.steps_per_epoch} at global batch {then.global_batch}), but at global batch "
                         f"{now.global_batch} an epoch is {now.epoch_images:,}; rerun at global batch "
                         f"{then.global_batch} (--batch-size-per-replica x replicas) to resume it, {START_OVER}")
    least = position.epoch + (1 if position.image else 0)
    if epochs < least:
        begun = f"epoch {position.epoch + 1} begun" if position.image else f"{position.epoch} epochs done"
        raise UsageError(f"--epochs {epochs} is fewer than the backup in {backup_dir} has trained ({begun}); rerun "
                         f"with --epochs {least} or more to resume it, {START_OVER}")


# ---------------------------------------------------------------- what the backup's model and optimizer are

# --fused-adam as the command line gives it, each way (off, on), and what the backup's optimizer state then holds.
FUSED_ADAM = (("with --no-fused-adam", "Keras's Adam's variables"), ("with --fused-adam", "the fused Adam's slots"))


def _shape(shape):
    return "x".join(map(str, shape)) or "a scalar"


def model_differences(then, now):
    """For people: how the backup's model variables `then` differ from this run's `now`, {path: shape} each."""
    return ([f"{name} is {_shape(then[name])} in it and {_shape(now[name])} here"
             for name in sorted(then.keys() & now.keys()) if then[name] != now[name]]
            + [f"{name} is only in it" for name in sorted(then.keys() - now.keys())]
            + [f"{name} is only here" for name in sorted(now.keys() - then.keys())])


def refuse_another_model(cfg, plan, model):
    """Raises UsageError, one line naming what differs and the ways out, when the backup `plan` resumes from holds
    another model (its variables' names or shapes) or another optimizer than this run's `model` and --fused-adam:
    its restore would fail on the first variable that differs. Checked before training, so the backup is left as
    it was. (The precision policy is no such change: the weights and Adam's slots are float32 under each, and
    --mixed-precision float16's loss scale, kept beside them, starts afresh when the backup has none.)"""
    if plan.checkpoint is None:
        return
    backup_dir = cfg.path(cfg.backup_dir)
    differences = model_differences(tf_private.backed_up_model(plan.checkpoint), tf_private.model_variables(model))
    if differences:
        more = f" (and {len(differences) - 2} more)" if len(differences) > 2 else ""
        raise UsageError(f"the backup in {backup_dir} holds another model than this run builds: "
                         f"{'; '.join(differences[:2])}{more}; rerun with the model.py that made it to resume it, "
                         f"{START_OVER}")
    fused = tf_private.backed_up_fused_adam(plan.checkpoint)
    if fused != cfg.fused_adam:
        (made, holds), (now, _) = FUSED_ADAM[fused], FUSED_ADAM[cfg.fused_adam]
        raise UsageError(f"the backup in {backup_dir} was made {made} (its optimizer state holds {holds}), this run "
                         f"is {now}; rerun {made} to resume it, {START_OVER}")


# ---------------------------------------------------------------- this run's steps from the position

@dataclasses.dataclass(frozen=True)
class Plan:
    """This run's epochs and steps from the backed-up position on, at this run's global batch.

    The epoch the backup was in is finished first: the rest of its seeded order from the first image not
    trained, in batches of the new global batch, the last one holding what is left (so it may be short, as
    every epoch's last batch may be); the epochs after it are whole, their batches counted from their own
    first image. Keras counts the steps of an epoch from 0 to `steps` - 1 whatever is left of it, so the
    resumed epoch's steps are numbered from `first_step`, which leaves exactly the steps its rest needs.
    """

    settings: Settings  # this run's
    epoch: int = 0  # the first epoch this run trains
    image: int = 0  # its images already trained
    optimizer_step: int = 0  # the optimizer's step count at the backup
    backed_up_batch: typing.Optional[int] = None  # the global batch the backup was made at; None when fresh
    checkpoint: typing.Optional[str] = None  # the backup's checkpoint that holds the position; None when fresh

    @classmethod
    def resuming(cls, position, settings, checkpoint=None):
        if position is None:
            return cls(settings)
        return cls(settings, position.epoch, position.image, position.optimizer_step,
                   position.settings.global_batch, checkpoint)

    @property
    def steps(self):
        return self.settings.steps

    @property
    def epoch_images(self):
        return self.settings.epoch_images

    @property
    def first_step(self):
        """The step of the first epoch `fit` starts at: as many steps before the end as its rest needs."""
        return self.steps - math.ceil((self.epoch_images - self.image) / self.settings.global_batch)

    @property
    def first_global_step(self):
        """The first step in this run's own numbering (epoch x steps + step), as `fit` counts."""
        return self.epoch * self.steps + self.first_step

    @property
    def step_offset(self):
        """This run's step number minus the optimizer's step count: the optimizer also counted the steps
        taken at another global batch before a resize, so its count is no epoch's measure."""
        return self.first_global_step - self.optimizer_step

    @property
    def resumed_after_images(self):
        """The training images the backup had trained: 0 for a fresh run."""
        return self.epoch * self.epoch_images + self.image

    def stream(self, epochs):
        """The training batches this run reads, to the end of epoch `epochs`: from its first untrained image on."""
        s = self.settings
        return input_engine.Stream(num_examples=s.num_examples, global_batch=s.global_batch, buffer_size=s.buffer_size,
                           seed=s.seed, epochs=epochs, first_epoch=self.epoch, first_image=self.image,
                           epoch_images=self.epoch_images)

    def train_images(self, epochs):
        """The images this run trains, to the end of epoch `epochs`."""
        return max(0, epochs * self.epoch_images - self.resumed_after_images)

    def images_done(self, epoch, last_step):
        """Images of `epoch` trained once its step `last_step` (Keras's numbering) is done."""
        first_step, first_image = (self.first_step, self.image) if epoch == self.epoch else (0, 0)
        return min(first_image + (last_step + 1 - first_step) * self.settings.global_batch, self.epoch_images)

    def position(self, epoch, last_step, optimizer_step):
        """The Position after step `last_step` of `epoch`, for the backup."""
        epoch, image = int(epoch), self.images_done(int(epoch), int(last_step))  # Keras may give numpy ints
        if image == self.epoch_images:
            epoch, image = epoch + 1, 0
        return Position(epoch, image, int(optimizer_step), self.settings)

    def describe(self):
        """Where the run resumes, for people: `epoch 2, image 28,800 of 60,000 (backed up at global batch 64,
        now 128)`; epochs are counted from 1, as Keras's progress bar counts them."""
        where = f"epoch {self.epoch + 1}, image {self.image:,} of {self.epoch_images:,}"
        if self.backed_up_batch == self.settings.global_batch:
            return where
        return f"{where} (backed up at global batch {self.backed_up_batch}, now {self.settings.global_batch})"


def start(backup_dir, settings, *, epochs, overwrite):
    """This run's Plan: from the newest intact checkpoint of the backup in `backup_dir` if there is one it can
    continue (UsageError if there is one it cannot), from the beginning with --overwrite or without a backup.
    Backup restores that same checkpoint once the model exists."""
    checkpoint, damaged = (None, []) if overwrite else newest_intact(backup_dir)
    if checkpoint is None:
        return Plan(settings)
    position = position_in(checkpoint, backup_dir)
    check(position, settings, epochs=epochs, backup_dir=backup_dir)
    plan = Plan.resuming(position, settings, checkpoint)
    if damaged:
        print(f"warning: the latest backup in {backup_dir} is damaged ({'; '.join(damaged)}); resuming from the "
              f"one before it at {plan.describe()}", file=sys.stderr)
    return plan


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


class PositionedBackup:
    """Mixed in before Keras's BackupAndRestore (callbacks.Backup), which it drives: backs up at each epoch's end,
    every `every_steps` steps if given, and at the next step boundary after SIGTERM, then raises `Preempted`; each
    backup also records its position in images and what that means (above), in the same checkpoint.

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
        self._record = tf.Variable("", trainable=False, name=RECORD)

    def on_train_begin(self, logs=None):
        # Keras's own on_train_begin, but for two things: its training state keeps BACKUPS_KEPT checkpoints, not
        # one, and it restores the one resume.start chose and read the position from (plan.checkpoint, the newest
        # that reads back whole), where Keras would restore the newest whatever its state. Every worker restores
        # from the chief's folder, as Keras's own does.
        tf_private.build_optimizer(self.model)  # as Keras does, so that the restore fills its slots
        state = tf_private.worker_training_state(self.model, self.backup_dir, self.save_freq)
        tf_private.attach_training_state(self, state)
        tf_private.keep_backups(state, BACKUPS_KEPT)
        if self._plan.checkpoint:
            tf_private.restore_backup(state, self._plan.checkpoint)  # the model, the optimizer and Keras's counters
        tf_private.back_up_also(state, RECORD, self._record)  # in the same checkpoint as the weights
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


def discard(backup_dir):
    """Once the run's results are written, its backup has nothing left to resume."""
    shutil.rmtree(backup_dir, ignore_errors=True)
