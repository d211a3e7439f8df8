"""Canaries for tf_private.py, the one module that uses TensorFlow's, tf_keras's and tfds's private parts and
error texts: each fails, naming the versions and what changed, when an upgrade moves a part the project relies on
(README, "Known issues"). Each drives the part for real, as the project does."""

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from machinery import tf_private
from processes import ROOT, free_ports, subprocess_env
from model import keras

# A fresh process's TensorFlow start and a 2 s registration deadline, on a loaded machine.
FORM_SECONDS = 120


def changed(what):
    """The canary's message: the versions installed and what no longer holds."""
    return (f"TensorFlow {tf.__version__}, tf_keras {keras.__version__}, tfds {tfds.__version__}: {what}; "
            "tf_private.py relies on it (README, \"Known issues\")")


def tiny_model():
    model = keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


# ---------------------------------------------------------------- Keras's BackupAndRestore, driven from outside

def test_optimizer_built_flag():
    """Keras's optimizers mark themselves built (`_built`) once their slots exist; the legacy ones (`--fused-adam`)
    create them as they first apply gradients, and have no `build`."""
    model = tiny_model()
    assert not getattr(model.optimizer, "_built", False)
    tf_private.build_optimizer(model)
    assert getattr(model.optimizer, "_built", None) is True and len(model.optimizer.variables) > 1, changed(
        "`optimizer.build` no longer sets `_built` and creates the slots")
    slots = list(model.optimizer.variables)
    tf_private.build_optimizer(model)
    assert list(model.optimizer.variables) == slots, changed("a built optimizer is built again")


def test_worker_training_state_and_its_counters(tmp_path):
    try:
        state = tf_private.worker_training_state(tiny_model(), str(tmp_path), 5)
    except AttributeError as err:
        pytest.fail(changed(f"keras.src.distribute.worker_training_state.WorkerTrainingState is gone ({err})"))
    for name in ("read_checkpoint_manager", "write_checkpoint_manager", "_ckpt_saved_epoch", "_ckpt_saved_batch"):
        assert hasattr(state, name), changed(f"WorkerTrainingState has no `{name}`")
    assert isinstance(state.write_checkpoint_manager, tf.train.CheckpointManager), changed(
        "WorkerTrainingState's write_checkpoint_manager is no tf.train.CheckpointManager")


def test_backup_and_restore_callback_internals(tmp_path):
    model = tiny_model()
    callback = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=5)
    callback.set_model(model)
    tf_private.attach_training_state(callback, tf_private.worker_training_state(model, str(tmp_path), 5))
    callback.on_epoch_begin(3)
    assert tf_private.current_epoch(callback) == 3, changed("BackupAndRestore.on_epoch_begin sets no `_current_epoch`")
    assert "batch" in inspect.signature(callback._backup).parameters, changed(
        "BackupAndRestore has no `_backup(epoch, batch)`")
    tf_private.back_up(callback, epoch=3, batch=2)
    assert tf.train.latest_checkpoint(str(tmp_path / "chief")), changed(
        "BackupAndRestore._backup writes no checkpoint in backup_dir/chief")


def backup_callback(model, backup_dir):
    """A BackupAndRestore with its training state, as callbacks.Backup sets them up at train begin."""
    callback = keras.callbacks.BackupAndRestore(str(backup_dir), save_freq=5, delete_checkpoint=False)
    callback.set_model(model)
    tf_private.build_optimizer(model)
    state = tf_private.worker_training_state(model, str(backup_dir), 5)
    tf_private.attach_training_state(callback, state)
    return callback, state


def backups(backup_dir):
    return list(tf.train.get_checkpoint_state(str(backup_dir / "chief")).all_model_checkpoint_paths)


def test_the_chief_keeps_the_backups_asked_for(tmp_path):
    callback, state = backup_callback(tiny_model(), tmp_path)
    tf_private.keep_backups(state, 2)
    for batch in range(3):
        tf_private.back_up(callback, epoch=0, batch=batch)
    kept = [os.path.basename(path) for path in backups(tmp_path)]
    assert kept == ["ckpt-2", "ckpt-3"], changed(
        f"the chief's WorkerTrainingState kept {kept} of three backups, not the last two: its write_checkpoint_manager "
        "is no longer its read_checkpoint_manager, or BackupAndRestore._backup no longer saves through it")


def test_a_chosen_backup_is_restored_with_what_it_also_saved(tmp_path):
    """What callbacks.Backup does: each backup also saves the record; a restart restores the one it chose, not the
    newest, and reads the record it holds."""
    model = tiny_model()
    callback, state = backup_callback(model, tmp_path)
    tf_private.keep_backups(state, 2)
    record = tf.Variable("", trainable=False)
    tf_private.back_up_also(state, "record", record)
    for batch in range(2):
        model.layers[0].kernel.assign(np.full((2, 1), batch + 1.0))
        record.assign(f"backup {batch}")
        tf_private.set_saved_position(state, epoch=0, batch=batch)
        tf_private.back_up(callback, epoch=0, batch=batch)
    first, second = backups(tmp_path)
    assert tf_private.backed_up_value(second, "record") == b"backup 1", changed(
        f"a variable set on the checkpoint of WorkerTrainingState's write_checkpoint_manager is not in the backup "
        f"under {'record' + tf_private.VALUE!r}: {tf.train.list_variables(second)}")
    assert tf_private.backed_up_value(first, "another") is None

    restored = tiny_model()
    _, state = backup_callback(restored, tmp_path)
    tf_private.restore_backup(state, first)
    assert restored.layers[0].kernel.numpy().tolist() == [[1.0], [1.0]], changed(
        "restoring through WorkerTrainingState's read_checkpoint_manager's checkpoint gives the model another kernel")
    assert int(state._ckpt_saved_batch.numpy()) == 0, changed(
        "restoring through WorkerTrainingState's read_checkpoint_manager's checkpoint does not restore its counters")


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_the_backups_model_and_optimizer_are_told_by_their_names(tmp_path, fused):
    """resume.refuse_another_model compares the model's variables, named as a checkpoint names them, with those
    in the backup, and tells the fused Adam's state from Keras's Adam's."""
    model = keras.Sequential([keras.Input(shape=(4, 4, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.legacy.Adam() if fused else keras.optimizers.Adam(), loss="mse")
    model.fit(np.zeros((2, 4, 4, 1)), np.zeros((2, 3)), verbose=0)  # the fused Adam makes its slots in its first step
    callback, _ = backup_callback(model, tmp_path)
    tf_private.back_up(callback, epoch=0, batch=0)
    checkpoint = tf.train.latest_checkpoint(str(tmp_path / "chief"))
    named = tf_private.model_variables(model)
    assert sorted(named.values()) == sorted(list(v.shape) for v in model.variables), changed(
        f"TensorFlow's checkpoint no longer reaches the model's variables through the objects it tracks: {named}")
    backed_up = tf_private.backed_up_model(checkpoint)
    assert backed_up == named, changed(
        f"the backup holds the model's variables as {backed_up}, the model names them {named} "
        f"(under {tf_private.MODEL!r}, without {tf_private.OPTIMIZER!r}, each ending {tf_private.VALUE!r})")
    assert tf_private.backed_up_fused_adam(checkpoint) is fused, changed(
        f"the fused Adam's step count is {'not ' if fused else ''}in the backup as {tf_private.FUSED_STEPS!r}: "
        f"{[name for name, _ in tf.train.list_variables(checkpoint) if name.startswith('model/optimizer/')]}")


def test_fit_resumes_at_the_position_set_in_the_training_state(tmp_path):
    """What callbacks.Backup does at train begin: its own training state, with the counters of the last backup;
    `fit` must then resume there (epoch 2, after step 3)."""
    seen = []

    class Resume(keras.callbacks.BackupAndRestore):
        def on_train_begin(self, logs=None):
            state = tf_private.worker_training_state(self.model, self.backup_dir, self.save_freq)
            tf_private.attach_training_state(self, state)
            tf_private.set_saved_position(state, epoch=1, batch=3)

    model = tiny_model()
    record = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(
        (tf_private.current_epoch(resume), batch)))
    resume = Resume(str(tmp_path), save_freq=5, delete_checkpoint=False)
    x = np.zeros((40, 2), np.float32)
    model.fit(x, x[:, :1], batch_size=4, epochs=2, steps_per_epoch=10, verbose=0, callbacks=[resume, record])
    assert seen and seen[0] == (1, 4) and len(seen) == 6, changed(
        f"`fit` no longer resumes at the model's `_training_state` counters (epoch 1, after step 3): it ran {seen}")


# ---------------------------------------------------------------- TensorFlow's coordination service

def test_coordination_service_parts():
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    for name in ("cluster_register_timeout_in_ms", "cluster_register_with_barrier", "service_leader"):
        assert name in fields, changed(f"the coordination service's config has no `{name}`")
    parameters = inspect.signature(context.Context.configure_coordination_service).parameters
    for name in ("service_type", "service_leader", "cluster_register_timeout_in_ms", "coordinated_jobs"):
        assert name in parameters, changed(f"configure_coordination_service takes no `{name}`")
    assert hasattr(context.Context, "coordination_service") and hasattr(context.Context, "wait_at_barrier"), changed(
        "the eager context has no `coordination_service` or `wait_at_barrier`")
    spec = tf.train.ClusterSpec({"chief": ["a:1"], "worker": ["b:1", "c:1"]})
    assert tf_private.coordination_leader(spec) == ("chief", 0), changed(
        f"multi_worker_util.coordination_leader gives {multi_worker_util.coordination_leader(spec)!r} for a chief")
    assert tf_private.coordination_leader(tf.train.ClusterSpec({"worker": ["b:1", "c:1"]})) == ("worker", 0), changed(
        "multi_worker_util.coordination_leader does not give worker 0 without a chief")


# In a fresh process, worker 0 of two forms the cluster as worker_group.form does; what TensorFlow raises is printed.
FORM = """
import json, os, socket, sys
import tensorflow as tf
from machinery import tf_private
ports, held = json.loads(sys.argv[1]), sys.argv[2] == "held"
if held:  # another process holds this worker's port
    holder = socket.socket()
    holder.bind(("", ports[0]))
    holder.listen()
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                      "task": {"type": "worker", "index": 0}})
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
tf_private.configure_coordination(resolver.cluster_spec(), ("chief", "worker"), 2)
try:
    tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
except tf.errors.OpError as err:
    print(json.dumps([type(err).__name__, err.message]))
"""


def formed(held):
    proc = subprocess.run([sys.executable, "-c", FORM, json.dumps(free_ports(2)), "held" if held else "free"],
                          cwd=ROOT, env={**subprocess_env(), "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=FORM_SECONDS)
    assert proc.stdout.strip(), changed(f"forming a cluster whose worker 1 never comes raised nothing:\n"
                                        f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def test_a_registration_that_times_out_names_the_tasks_that_never_came():
    """The deadline configure_coordination sets holds, and the error's text lists who never registered."""
    kind, message = formed(held=False)
    assert kind == "DeadlineExceededError", changed(f"a registration past its deadline raised {kind}: {message}")
    assert tf_private.timed_out_tasks(message) == [("worker", 1)], changed(
        f"the text after {tf_private.TIMED_OUT!r} no longer lists the task that never came: {message!r}")


def test_a_taken_port_is_told_by_its_text():
    kind, message = formed(held=True)
    assert kind == "UnknownError" and tf_private.grpc_server_not_started(message), changed(
        f"a taken port raised {kind}({message!r}), without {tf_private.GRPC_NOT_STARTED!r}")


# ---------------------------------------------------------------- TensorFlow's error texts, as raised

# A device whose every write fails for want of space, as a full file system's do.
FULL = "/dev/full"


@pytest.mark.skipif(not os.path.exists(FULL), reason=f"no {FULL} here")
def test_a_write_that_finds_no_room_names_its_file():
    """Both ways TensorFlow writes files, an op and gfile (a checkpoint's SaveV2 on a full tmpfs is
    tests/test_storage.py's)."""
    writes = {"tf.io.write_file": lambda: tf.io.write_file(FULL, "x" * 2**17),
              "tf.io.gfile": lambda: tf.io.gfile.GFile(FULL, "w").write("x" * 2**17)}
    for how, write in writes.items():
        with pytest.raises(tf.errors.OpError) as raised:
            write()
        assert tf_private.no_space_for(str(raised.value)) == FULL, changed(
            f"{how} on a full device raised {type(raised.value).__name__}({str(raised.value)!r}), which "
            f"{tf_private.NO_SPACE.pattern!r} does not find {FULL} in")
    assert tf_private.no_space_for("/tmp/x; Permission denied") is None


# A registration timed out (the test above), and a collective aborted (tests/test_schedulers.py): TensorFlow 2.21's
# texts, as the parsers meet them. The canaries above and the lost-worker tests check them against TensorFlow.
TIMED_OUT = (
    "Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This usually happens because a task triggered "
    "the barrier too early or too slowly. Please look at the task logs (both timed out and first task) to debug "
    "further.\n# of tasks that reached the barrier: 1/2.\nThe first task at the barrier: /job:worker/replica:0/task:0. "
    "Some timed out task names:\n/job:worker/replica:0/task:1\n\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/RegisterTask:\n:UNKNOWN:Error received "
    "from peer  {grpc_status:4, grpc_message:\"Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This "
    "usually happens because a task triggered the barrier too early or too slowly. Please look at the task logs (both "
    "timed out and first task) to debug further.\\n# of tasks that reached the barrier: 1/2.\\nThe first task at the "
    "barrier: /job:worker/replica:0/task:0. Some timed out task names:\\n/job:worker/replica:0/task:1\\n\"}")
ABORTED = ("Collective ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error information from "
           "remote target /job:worker/replica:0/task:0 while calling /tensorflow.WorkerService/RecvBuf:\n")


def test_the_parsers_read_tensorflows_texts():
    # Only the tasks listed, not the task that relayed the error.
    assert tf_private.timed_out_tasks(TIMED_OUT) == [("worker", 1)]
    assert tf_private.timed_out_tasks("Deadline Exceeded") == []
    assert tf_private.named_tasks(ABORTED) == [("worker", 0)]
    assert tf_private.abort_reason(ABORTED) == "recvmsg:Connection reset by peer"
    assert tf_private.leader_heartbeat_failed("Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat")


# ---------------------------------------------------------------- the multi-device iterator's device pipelines

def test_device_datasets_pass_through_the_wrap(monkeypatch):
    from tensorflow.python.data.ops import multi_device_iterator_ops

    # The wrap is for the whole process: put TensorFlow's own function back after the test.
    monkeypatch.setattr(multi_device_iterator_ops, "_create_device_dataset",
                        getattr(multi_device_iterator_ops, "_create_device_dataset", None))
    wrapped = []

    def wrap(dataset):
        wrapped.append(dataset)
        return dataset

    assert tf_private.wrap_device_datasets(wrap), changed(
        "tensorflow.python.data.ops.multi_device_iterator_ops has no `_create_device_dataset`")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4)))
    assert next(iterator).numpy().tolist() == [0, 1, 2, 3]
    assert wrapped, changed("the multi-device iterator no longer builds its device-side datasets through "
                            "`_create_device_dataset`")


# ---------------------------------------------------------------- tfds's builder, preparing without its two lines

def test_a_prepare_prints_tfds_lines_only_when_not_told_otherwise(tmp_path, dataset_arrays, capfd):
    from config import Config
    from machinery import tfds_builders

    builder = tfds_builders.arrays_builder(Config.dataset, dataset_arrays)

    def prepared(builder):
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        return capfd.readouterr().out

    capfd.readouterr()
    loud = prepared(builder(data_dir=str(tmp_path / "loud")))
    assert "Downloading and preparing dataset" in loud and "downloaded and prepared" in loud, changed(
        f"tfds's builder no longer prints its two lines around a prepare, and without_prepare_lines has nothing "
        f"left to do: it printed {loud!r}")
    quiet = prepared(tf_private.without_prepare_lines(builder(data_dir=str(tmp_path / "quiet"))))
    assert "Downloading" not in quiet and "downloaded" not in quiet, changed(
        f"tfds's builder prints its lines through something other than `_log_download_bytes` and "
        f"`_log_download_done` now: {quiet!r}")
