"""Every use of TensorFlow's and tf_keras's private parts, in one room: what the project needs that neither
offers publicly. Nothing else in the project reaches into `keras.src`, `tensorflow.python` or
`tensorflow.compiler`, or reads a private attribute or an error's text.

Each use is listed in README.md's "Known issues" and has a canary in tests/test_tf_private.py, which fails
naming the TensorFlow version and what changed when an upgrade moves it.

- Keras's BackupAndRestore, driven from outside (resume.Backup): its training state (`WorkerTrainingState`,
  with the counters `_ckpt_saved_epoch` and `_ckpt_saved_batch`), where the callback and the model keep it
  (`_training_state`), its `_backup` and `_current_epoch`, and the optimizer's `_built`.
- TensorFlow's coordination service (worker_group): configured, asked whether it runs, and waited at.
- TensorFlow's error texts (worker_group): the tasks named in an error, the tasks a registration timed out on,
  the reason a collective was aborted, and a gRPC server that could not start.
- The device-side pipelines of TensorFlow's multi-device iterator (data): `_create_device_dataset`.
- The variables Keras creates in a train step's first call (train_mnist_mirrored's fit, export.reload): a legacy
  optimizer's `_create_all_weights`, the compiled loss's and metrics' `build`.
"""

import re

# ---------------------------------------------------------------- Keras's BackupAndRestore, driven from outside


def build_optimizer(model):
    """Creates the optimizer's slots now, as BackupAndRestore does, so that a restore fills them (`_built`)."""
    optimizer = model.optimizer
    if callable(getattr(optimizer, "build", None)) and not getattr(optimizer, "_built", False):
        optimizer.build(model.trainable_variables)


def create_step_variables(model, *, labels_shape=(1,)):
    """Creates now, in the model's strategy scope, the variables Keras would create in the first call of its train
    or test function: the optimizer's slots and hyperparameters, the compiled loss's and metrics' totals. A
    tf.function whose first call creates variables traces the step a second time, without creating them; made
    beforehand, it traces the step once. `labels_shape` is one batch of labels (sparse: one per image), from
    which Keras picks the accuracy's kind."""
    import tensorflow as tf

    with model.distribute_strategy.scope():
        optimizer = model.optimizer
        if optimizer is not None and hasattr(optimizer, "_create_all_weights"):  # the legacy ones (--fused-adam)
            optimizer._create_all_weights(model.trainable_variables)
        elif optimizer is not None:
            build_optimizer(model)
        outputs = tf.zeros((labels_shape[0], *model.output_shape[1:]))
        model.compiled_loss.build(outputs)
        model.compiled_metrics.build(outputs, tf.zeros(labels_shape))


def worker_training_state(model, backup_dir, save_freq):
    """Keras's WorkerTrainingState: BackupAndRestore's checkpoint managers (`read_checkpoint_manager`,
    `write_checkpoint_manager`) and its counters, for `model`."""
    from model import keras

    return keras.src.distribute.worker_training_state.WorkerTrainingState(model, backup_dir, save_freq)


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


def back_up(callback, *, epoch, batch):
    """BackupAndRestore's own backup: the model, the optimizer and the counters, through its checkpoint manager."""
    callback._backup(epoch=epoch, batch=batch)


def current_epoch(callback):
    """The epoch BackupAndRestore's on_epoch_begin last saw."""
    return callback._current_epoch


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
