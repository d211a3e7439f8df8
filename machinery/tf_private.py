"""Every use of TensorFlow's, tf_keras's and tfds's private parts and error texts, in one room: what the project
needs that none of them offers publicly. Nothing else in the project reaches into `keras.src`, `tensorflow.python`
or `tensorflow.compiler`, names the layout of Keras's backup checkpoint, reads or replaces a private attribute, or
parses an error's text.

Each use is listed in README.md's "Known issues" and has a canary in tests/test_tf_private.py, which fails
naming the versions and what changed when an upgrade moves it.

- Keras's BackupAndRestore, driven from outside (callbacks.Backup): its training state (`WorkerTrainingState`,
  with the counters `_ckpt_saved_epoch` and `_ckpt_saved_batch`), where the callback and the model keep it
  (`_training_state`), its `_backup` and `_current_epoch`, and the optimizer's `_built`; the chief's checkpoint
  manager, which is both `read_checkpoint_manager` and `write_checkpoint_manager`, replaced to keep more backups;
  the checkpoint they hold, restored from a chosen backup and given the position's record to save.
- The layout of Keras's backup checkpoint (resume): TensorFlow's keys (a path, then `/.ATTRIBUTES/VARIABLE_VALUE`),
  the model under `model` and its optimizer under `optimizer`, the fused Adam's slots and its `iter`.
- TensorFlow's coordination service (worker_group): configured, asked whether it runs, and waited at.
- TensorFlow's error texts (worker_group, outputs): the tasks named in an error, the tasks a registration timed
  out on, the reason a collective was aborted, a gRPC server that could not start, and the file a write found no
  room for.
- The device-side pipelines of TensorFlow's multi-device iterator (input_engine): `_create_device_dataset`.
- tfds's builder, preparing without its two lines (tfds_builders): `_log_download_bytes` and `_log_download_done`.
"""

import errno
import os
import re

# ---------------------------------------------------------------- Keras's BackupAndRestore, driven from outside

KERAS_PACKAGES = ("tf_keras", "keras")  # the packages a model's Keras classes come from: Keras 2's and Keras 3's


def build_optimizer(model):
    """Creates the optimizer's slots now, as BackupAndRestore does, so that a restore fills them (`_built`)."""
    optimizer = model.optimizer
    if callable(getattr(optimizer, "build", None)) and not getattr(optimizer, "_built", False):
        optimizer.build(model.trainable_variables)


def worker_training_state(model, backup_dir, save_freq):
    """Keras's WorkerTrainingState: BackupAndRestore's checkpoint managers (`read_checkpoint_manager`,
    `write_checkpoint_manager`) and its counters, for `model`, from the Keras that built it."""
    import importlib

    # The Keras of the first of the model's classes that is Keras's own: a user's subclass lives in model.py.
    keras = next(package for package in (cls.__module__.split(".")[0] for cls in type(model).__mro__)
                 if package in KERAS_PACKAGES)
    module = importlib.import_module(f"{keras}.src.distribute.worker_training_state")
    return module.WorkerTrainingState(model, backup_dir, save_freq)


def attach_training_state(callback, state):
    """Puts `state` where Keras looks for it: on the BackupAndRestore `callback` (its own methods) and on its
    model (`fit` reads the epoch and step to resume at from there)."""
    callback.model._training_state = callback._training_state = state


def training_state(callback):
    return callback._training_state


def set_saved_position(state, *, epoch=None, batch=None):
    """Keras's counters of the last backup: `fit` resumes epoch `epoch` after step `batch` (-1: at step 0)."""
    if epoch is not None:
        state._ckpt_saved_epoch.assign(epoch)
    if batch is not None:
        state._ckpt_saved_batch.assign(batch)


def keep_backups(state, count):
    """The chief keeps `count` backup checkpoints, not Keras's one (`MAX_CHECKPOINT_TO_KEEP`). Relies on the chief's
    WorkerTrainingState holding one tf.train.CheckpointManager as both its `write_checkpoint_manager` and its
    `read_checkpoint_manager` (it writes where every worker reads): replaced by one over the same checkpoint and
    folder. Another worker's, which writes to a folder Keras removes after each backup, is left as it is."""
    import tensorflow as tf

    if state.write_checkpoint_manager is state.read_checkpoint_manager:
        state.write_checkpoint_manager = state.read_checkpoint_manager = tf.train.CheckpointManager(
            state.read_checkpoint_manager.checkpoint, state.read_checkpoint_manager.directory, max_to_keep=count)


def restore_backup(state, checkpoint):
    """Restores the model, the optimizer and Keras's counters from the backup's `checkpoint` (a path), where Keras
    restores the newest whatever its state: through the tf.train.Checkpoint of WorkerTrainingState's
    `read_checkpoint_manager`."""
    state.read_checkpoint_manager.checkpoint.restore(checkpoint)


def back_up_also(state, name, variable):
    """Every backup from now on also saves `variable`, under `name`, in the same checkpoint as the model: an
    attribute of the tf.train.Checkpoint of WorkerTrainingState's `write_checkpoint_manager`. backed_up_value
    reads it back."""
    setattr(state.write_checkpoint_manager.checkpoint, name, variable)


def back_up(callback, *, epoch, batch):
    """BackupAndRestore's own backup: the model, the optimizer and the counters, through its checkpoint manager."""
    callback._backup(epoch=epoch, batch=batch)


def current_epoch(callback):
    """The epoch BackupAndRestore's on_epoch_begin last saw."""
    return callback._current_epoch


# ---------------------------------------------------------------- what Keras's backup checkpoint holds, by name

# TensorFlow's checkpoint keys: a variable's path of attribute names, then VALUE. Keras's backup checkpoint holds
# the model under MODEL (WorkerTrainingState's tf.train.Checkpoint) and the model its optimizer under OPTIMIZER;
# the legacy (fused) Adam keeps each slot under its variable's OPTIMIZER_SLOT and counts its steps in FUSED_STEPS,
# where Keras's Adam has `_iterations`, and its slots in `_variables`.
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
MODEL = "model"
OPTIMIZER = "optimizer"
OPTIMIZER_SLOT = "/.OPTIMIZER_SLOT/"
FUSED_STEPS = "iter"


def backed_up_value(checkpoint, name):
    """The value back_up_also saved under `name` in the backup's `checkpoint` (a path); None when it holds none."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(checkpoint)
    return reader.get_tensor(name + VALUE) if reader.has_tensor(name + VALUE) else None


def model_variables(model):
    """{path: shape} of the model's own variables as a checkpoint names them (`layer_with_weights-1/kernel`),
    found as TensorFlow's checkpoint finds them: breadth first through the objects the model tracks, each at the
    first path that reaches it. The optimizer's are left out."""
    import collections

    import tensorflow as tf

    found, seen, queue = {}, set(), collections.deque([((), model)])
    while queue:
        path, node = queue.popleft()
        for name, child in tf.train.TrackableView(node).children(node).items():
            if id(child) in seen or (not path and name == OPTIMIZER):
                continue
            seen.add(id(child))
            if isinstance(child, tf.Variable):
                found["/".join(path + (name,))] = list(child.shape)
            else:
                queue.append((path + (name,), child))
    return found


def backed_up_model(checkpoint):
    """{path: shape} of the model's variables in a backup checkpoint, named as model_variables names them, without
    its optimizer's."""
    import tensorflow as tf

    prefix = MODEL + "/"
    return {name[len(prefix):-len(VALUE)]: shape for name, shape in tf.train.list_variables(checkpoint)
            if name.startswith(prefix) and name.endswith(VALUE) and OPTIMIZER_SLOT not in name
            and not name.startswith(f"{prefix}{OPTIMIZER}/")}


def backed_up_fused_adam(checkpoint):
    """Whether the backup's optimizer state is the fused Adam's (keras.optimizers.legacy.Adam) rather than Keras's
    Adam's. Neither restores from the other's state."""
    import tensorflow as tf

    return f"{MODEL}/{OPTIMIZER}/{FUSED_STEPS}{VALUE}" in {name for name, _ in tf.train.list_variables(checkpoint)}


# ---------------------------------------------------------------- TensorFlow's coordination service


def configure_coordination(cluster_spec, jobs, register_seconds):
    """What MultiWorkerMirroredStrategy would configure itself, plus a deadline on registration that holds for
    every task, the service's host included (`cluster_register_with_barrier`)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=multi_worker_util.coordination_leader(spec),
        cluster_register_timeout_in_ms=register_seconds * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
                          for job in jobs if job in spec.jobs])
    context.context().coordination_service.cluster_register_with_barrier = True


def coordination_configured():
    """Whether this process configured TensorFlow's coordination service (its multi-worker runtime started)."""
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def coordination_leader(cluster_spec):
    """The task that hosts the coordination service, as (job, index): the chief, or else worker 0."""
    from tensorflow.python.distribute import multi_worker_util

    return named_tasks(multi_worker_util.coordination_leader(multi_worker_util.normalize_cluster_spec(cluster_spec)))[0]


def wait_at_barrier(name, seconds):
    """Returns once every task reached the barrier `name`; raises after `seconds`, or when a task is gone."""
    from tensorflow.python.eager import context

    context.context().wait_at_barrier(name, seconds * 1000)


# ---------------------------------------------------------------- TensorFlow's error texts

# How TensorFlow names a task in its errors: /job:worker/replica:0/task:1, or /job:worker/task:1.
TASK = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
# A registration that timed out lists the tasks that never registered after these words.
TIMED_OUT = "timed out task names:"
# An aborted collective op says why after these words.
ABORTED_BY = "Collective ops is aborted by:"
# A gRPC server whose port another process holds.
GRPC_NOT_STARTED = "Could not start gRPC server"
# A write that found its file system full: the file's name, then the C library's words for ENOSPC.
NO_SPACE = re.compile(rf"(\S*); {os.strerror(errno.ENOSPC)}")
# The call that failed when the coordination service's host stopped answering this task's heartbeats.
LEADER_HEARTBEAT = "RPC: /tensorflow.CoordinationService/Heartbeat"


def named_tasks(message):
    """Every task `message` names, as (job, index), first mention first. Which one was lost it does not say:
    it may name the task that raised it, the one that relayed it, or the one gone."""
    return list(dict.fromkeys((job, int(index)) for job, index in TASK.findall(message)))


def timed_out_tasks(message):
    """The tasks a registration's DeadlineExceededError lists as never registered, as (job, index): the lines after
    TIMED_OUT, up to the first empty one (the message goes on to name the task that relayed it)."""
    if TIMED_OUT not in message:
        return []
    return named_tasks(message.split(TIMED_OUT, 1)[1].split("\n\n", 1)[0])


def abort_reason(message):
    """Why a collective op was aborted: the first line after ABORTED_BY (the message's first line without it)."""
    return message.split(ABORTED_BY)[-1].strip().splitlines()[0].rstrip(":")


def no_space_for(message):
    """The file TensorFlow's error `message` says it found no room to write ("" when it names none); None when the
    message is no such failure. TensorFlow's file system puts the C library's words for ENOSPC after the file's
    name: "<file>; No space left on device"."""
    found = NO_SPACE.search(message)
    return found[1] if found else None


def grpc_server_not_started(message):
    return GRPC_NOT_STARTED in message


def leader_heartbeat_failed(message):
    """Whether `message` is this task's heartbeat to the coordination service's host going unanswered."""
    return LEADER_HEARTBEAT in message


# ---------------------------------------------------------------- the multi-device iterator's device pipelines


def wrap_device_datasets(wrap):
    """From now on, in this process, every device-side dataset TensorFlow's multi-device iterator builds (one per
    replica, with tf.data's default options, which nothing passed to a strategy or to Keras reaches) is
    `wrap(dataset)`. TensorFlow's private `_create_device_dataset` is wrapped, once per `wrap`; returns False, and
    changes nothing, when this TensorFlow has no such function."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if create is None:
        return False
    if getattr(create, "wrapped_with", None) is wrap:
        return True

    def create_wrapped(*args, **kwargs):
        return wrap(create(*args, **kwargs))

    create_wrapped.wrapped_with = wrap
    multi_device_iterator_ops._create_device_dataset = create_wrapped
    return True


# ---------------------------------------------------------------- tfds's builder, preparing without its two lines


def without_prepare_lines(builder):
    """`builder`, whose download_and_prepare no longer prints tfds's two lines around its work: "Downloading and
    preparing dataset <size> ..." and "Dataset <name> downloaded and prepared to <dir>. ...". Nothing is
    downloaded in an offline prepare, and the prepare command says what it does itself. tfds prints them from the
    builder's private `_log_download_bytes` and `_log_download_done`, replaced here on this instance."""
    builder._log_download_bytes = builder._log_download_done = lambda: None
    return builder
