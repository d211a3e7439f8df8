"""Launching from schedulers: Slurm's srun and a shared data dir, Kubeflow's TFJob and a lost worker (exit 138; the
restart leaves nothing in the node's TMPDIR), every bad Slurm variable in one line, TF_CONFIG over Slurm's, and a
survivor naming the worker it lost."""

import json
import os
import signal
import socket
import sys

import pytest

import config
from machinery import worker_group
from machinery import terminal
import train_mnist_mirrored
from machinery import exits
from config import Config
from processes import (Worker, apply_env, assert_one_port_warning, assert_refused_in_one_line, finish, free_ports,
                       run_under_broken_tf_config)
from runs import assert_only_documented_outputs, smoke_args
from small_data import dataset_folder


def _results(output_dir):
    with open(os.path.join(output_dir, "results.json")) as f:
        return json.load(f)


def _left_in(tmpdir):
    """What a worker left under its TMPDIR, its own output folder included: nothing (docs/faults.md, "Nothing left
    behind")."""
    return os.listdir(tmpdir)


def _no_nvidia_smi():
    """A PATH without nvidia-smi: the machine without GPUs on which TensorFlow's own Slurm resolver fails."""
    return os.path.dirname(sys.executable)


# ---------------------------------------------------------------- Slurm

def srun_env(rank, tasks, node="localhost"):
    """What srun gives task `rank` of a step of `tasks` tasks on one node (its name is the node's hostname;
    localhost here, so that the test's workers stay on loopback)."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0", "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": node, "SLURM_JOB_NODELIST": node,
        "SLURM_STEP_TASKS_PER_NODE": str(tasks), "SLURM_TASKS_PER_NODE": str(tasks), "SLURMD_NODENAME": node,
    }


@pytest.mark.slow
def test_two_slurm_tasks_prepare_one_shared_data_dir_and_task_0_writes_outputs(tmp_path, idx_dir):
    """Two tasks of one node, as srun starts them, given the IDX files and one fresh data dir (shared storage), with
    the multi-worker choices no other run makes (test_options.py): TensorFlow's choice of collective, all-reducing
    in float16, under mixed float16."""
    base = free_ports(2, consecutive=True)[0]
    shared, output_dir = tmp_path / "shared_tfds", str(tmp_path / "out")
    args = ["--strategy", "multiworker", "--slurm-port-base", str(base), "--idx-dir", idx_dir,
            "--communication", "auto", "--allreduce-dtype", "float16", "--mixed-precision",
            *smoke_args(str(shared), output_dir)]
    workers = [Worker(args, {**srun_env(rank, 2), "PATH": _no_nvidia_smi()}, tmp_path, f"task{rank}")
               for rank in range(2)]
    for rank, (w, status) in enumerate(zip(workers, finish(workers))):
        assert status == 0, w.stderr[-3000:]
        assert "Traceback" not in w.stderr
        # Task k of the node listens on base + k, and says so once.
        assert_one_port_warning(w.stderr, port=base + rank)
    results = _results(output_dir)
    assert results["replicas"] == 2 and results["strategy"] == "multiworker"
    assert (results["communication"], results["allreduce_dtype"], results["dtype_policy"]) == (
        "auto", "float16", "mixed_float16")
    assert results["eval_accuracy_checkpoint"] == results["eval_accuracy_unreplicated"] > 0.5
    # Task 0 is the chief: only its outputs are in --output-dir; neither task left anything under its TMPDIR.
    assert_only_documented_outputs(output_dir)
    assert _left_in(tmp_path / "task0") == _left_in(tmp_path / "task1") == []
    # One task prepared the data while the other waited for its lock (or found it done): one copy, no leftovers.
    preparers = [w for w in workers if any(line.startswith(f"preparing {Config.dataset} in") for line in w.stdout.splitlines())]
    assert len(preparers) == 1
    assert os.listdir(shared / Config.dataset) == [dataset_folder(shared).name]


# ---------------------------------------------------------------- Kubernetes: a TFJob that loses a worker

EPOCHS = 4
# Short epochs of single steps, so that a worker is killed inside epoch 3 (or soon after: it still is lost).
LOST_FLAGS = ["--epochs", str(EPOCHS), "--steps-per-epoch", "10", "--batch-size-per-replica", "4",
              "--steps-per-execution", "1"]


def tfjob_env(cluster, task_type):
    """TF_CONFIG as Kubeflow's training operator writes it for a TFJob with a chief and one worker."""
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0},
                                     "environment": "cloud"})}


@pytest.mark.slow
def test_tfjob_worker_lost_exits_138_and_restart_resumes(tmp_path, data_dir):
    chief_port, worker_port = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    output_dir = str(tmp_path / "out")
    args = ["--strategy", "multiworker", *LOST_FLAGS, "--data-dir", data_dir, "--output-dir", output_dir]

    node_tmpdir = tmp_path / "tmpdir"  # both pods' TMPDIR, as on one node, in each attempt
    node_tmpdir.mkdir()

    def start(attempt):
        return [Worker(args, {**tfjob_env(cluster, task), "TMPDIR": str(node_tmpdir)}, tmp_path, f"{task}{attempt}")
                for task in ("chief", "worker")]

    chief, worker = start(1)
    try:
        chief.wait_for(f"Epoch 3/{EPOCHS}")  # epochs 1 and 2 are backed up
        worker.proc.send_signal(signal.SIGKILL)
        status = chief.proc.wait(timeout=300)  # a guard against a hang; the survivor takes seconds
    finally:
        finish([chief, worker])
    assert status == exits.EXIT_PEER_LOST, chief.stderr[-3000:]
    # One line says what was lost and what to do, and it is the last; no Python traceback.
    assert "Traceback" not in chief.stderr
    last = chief.last_stderr_line
    assert last.startswith("error: lost worker 0 ") and "restart every worker with the same command" in last
    assert not os.path.exists(os.path.join(output_dir, "results.json"))

    # Kubeflow restarts every pod with the same command: the run resumes from the last backup.
    restarted = start(2)
    for w, status in zip(restarted, finish(restarted)):
        assert status == 0, w.stderr[-3000:]
    results = _results(output_dir)
    assert results["replicas"] == 2
    assert 2 <= results["resumed_from_epoch"] < EPOCHS
    trained = [n for n in range(1, EPOCHS + 1) if f"Epoch {n}/{EPOCHS}" in restarted[0].stdout]
    assert trained == list(range(results["resumed_from_epoch"] + 1, EPOCHS + 1))
    # The chief wrote the outputs; the worker wrote only to its own temporary folder, and removed it. Nothing is
    # left in the node's TMPDIR: the restart emptied what the killed worker could not remove.
    assert_only_documented_outputs(output_dir)
    assert _left_in(node_tmpdir) == []


# What TensorFlow 2.21 raised in a survivor when its peer was killed or stopped (tests/test_schedulers.py's TFJob run,
# chief and worker on loopback), from "Collective ops is aborted by:" on; the traceback before it is left out. The
# message names the task the failed call went to, which may be this one: the chief that said "lost chief 0" of
# itself had read RESET_NAMING_THIS_TASK.
ABORTED = "Collective ops is aborted by: "
NODE = ("\nThe error could be from a previous operation. Restart your program to reset.\n"
        "\t [[{{node Adam/CollectiveReduceV2}}]] [Op:__inference_train_function_1285]")


def rpc_failed(reason, task):
    """The text of a collective aborted by `reason` in a call to `task` (/job:chief/replica:0/task:0, say)."""
    return (f"{ABORTED}{reason}\nAdditional GRPC error information from remote target {task} while calling "
            f"/tensorflow.WorkerService/RecvBuf:\n:UNKNOWN:Error received from peer  {{grpc_status:14, "
            f'grpc_message:"{reason}"}}{NODE}')


RESET_NAMING_THE_PEER = rpc_failed("recvmsg:Connection reset by peer", "/job:worker/replica:0/task:0")
RESET_NAMING_THIS_TASK = rpc_failed("recvmsg:Connection reset by peer", "/job:chief/replica:0/task:0")
SOCKET_CLOSED = rpc_failed("Socket closed", "/job:chief/replica:0/task:0")
HEARTBEATS_STOPPED = (ABORTED + "Error reported from /job:worker/task:0: The following tasks are unhealthy (stopped "
                      "sending heartbeats):\n/job:worker/replica:0/task:0\nThe tasks have crashed. Check the task logs "
                      "for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further." + NODE)
LEADER_HEARTBEAT = ABORTED + "Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat" + NODE


@pytest.fixture
def tfjob_cluster():
    """A TFJob's chief and worker as each sees the cluster, on ports of their own. `answering` holds a listening
    socket on a task's port (a process alive, or stopped: the kernel still accepts); any other port refuses, as a
    killed process's does."""
    import tensorflow as tf

    ports = dict(zip(("chief", "worker"), free_ports(2)))
    spec = tf.train.ClusterSpec({task: [f"127.0.0.1:{port}"] for task, port in ports.items()})
    listeners = []

    def seen_by(task_type, answering=()):
        for task in answering:
            listener = socket.socket()
            listener.bind(("127.0.0.1", ports[task]))
            listener.listen()
            listeners.append(listener)
        return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type=task_type, task_id=0)

    yield seen_by
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize("survivor, answering, message, lost", [
    # A killed peer's port refuses: that names it, whatever the message names.
    ("chief", [], RESET_NAMING_THE_PEER, "lost worker 0 of this multi-worker run (recvmsg:Connection reset by peer)"),
    ("chief", [], RESET_NAMING_THIS_TASK, "lost worker 0 of this multi-worker run (recvmsg:Connection reset by peer)"),
    ("worker", [], SOCKET_CLOSED, "lost chief 0 of this multi-worker run (Socket closed)"),
    # A stopped peer's port still answers: the message's other task, or the coordination service's host.
    ("chief", ["worker"], RESET_NAMING_THE_PEER, "lost worker 0 of this multi-worker run ("),
    ("chief", ["worker"], HEARTBEATS_STOPPED, "lost worker 0 of this multi-worker run (Error reported from "),
    ("worker", ["chief"], LEADER_HEARTBEAT, "lost chief 0 of this multi-worker run (Deadline Exceeded)"),
    # The peer answers and the message names only this task: which one was lost is not known, and it says so.
    ("chief", ["worker"], RESET_NAMING_THIS_TASK, "lost a worker of this multi-worker run, but cannot tell which"),
], ids=["reset-peer-named", "reset-self-named", "socket-closed", "stopped-peer-named", "heartbeats-stopped",
        "leader-stopped", "self-named-peer-answers"])
def test_a_survivor_names_the_worker_it_lost_never_itself(tfjob_cluster, survivor, answering, message, lost):
    said = worker_group.lost_workers(tfjob_cluster(survivor, answering), message)
    assert said.startswith(lost), said
    assert not said.startswith(f"lost {survivor} 0 "), said


def test_lost_peer_is_named_only_for_multiworker_collective_failures():
    import tensorflow as tf

    multi, single = config.Config(strategy="multiworker"), config.Config()
    # Before the cluster formed, nothing tells which worker is gone.
    assert worker_group.lost_peer(multi, tf.errors.UnavailableError(None, None, RESET_NAMING_THIS_TASK)) == (
        "lost a worker of this multi-worker run, but cannot tell which (recvmsg:Connection reset by peer)")
    assert worker_group.lost_peer(multi, tf.errors.DeadlineExceededError(None, None, LEADER_HEARTBEAT))
    # Other errors keep their own status and traceback: only a multi-worker run loses peers.
    assert worker_group.lost_peer(single, tf.errors.UnavailableError(None, None, RESET_NAMING_THE_PEER)) is None
    assert worker_group.lost_peer(multi, tf.errors.InvalidArgumentError(None, None, RESET_NAMING_THE_PEER)) is None
    assert worker_group.lost_peer(multi, ValueError(RESET_NAMING_THE_PEER)) is None


# ---------------------------------------------------------------- bad Slurm variables and options: exit 2

@pytest.fixture
def slurm_step(monkeypatch, tmp_path, capsys):
    """srun's variables for task `rank` of a one-node step, in this process, on a machine without GPUs."""
    # TensorFlow's first GPU probe in a process may print CUDA's cuInit line; let it happen here, not in the test.
    terminal.start_tensorflow(verbose=False)
    capsys.readouterr()
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", _no_nvidia_smi())

    def enter(rank=0, tasks=2, **changes):
        apply_env(monkeypatch, {**srun_env(rank, tasks), **changes})
    return enter


@pytest.mark.parametrize("changes, flags, words", [
    ({"SLURM_STEP_NUM_TASKS": None, "SLURM_STEP_NODELIST": None, "SLURM_STEP_TASKS_PER_NODE": None}, [],
     ["SLURM_STEP_NUM_TASKS", "srun"]),
    ({"SLURM_PROCID": "one"}, [], ["SLURM_PROCID", "'one'"]),
    ({"SLURM_PROCID": "2"}, [], ["SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS=2"]),
    ({"SLURM_STEP_NODELIST": "node[1-"}, [], ["node[1-", "srun"]),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, [], ["two", "srun"]),
    ({"SLURM_STEP_NUM_TASKS": "3"}, [], ["3", "srun"]),
    ({}, ["--slurm-port-base", "0"], ["--slurm-port-base", "0"]),
    ({}, ["--slurm-port-base", "70000"], ["--slurm-port-base", "70000"]),
    ({"SLURM_PROCID": "1"}, ["--slurm-port-base", "65535"], ["port 65536", "--slurm-port-base"]),
    # More GPUs in CUDA_VISIBLE_DEVICES than any test machine has: the task's share is not there.
    ({"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(64)))}, [], ["GPUs", "TensorFlow sees"]),
], ids=["batch-script-without-srun", "procid-not-a-number", "procid-too-big", "bad-nodelist", "bad-tasks-per-node",
        "tasks-disagree", "port-base-0", "port-base-too-big", "port-past-65535", "gpus-not-there"])
def test_bad_slurm_step_is_refused_in_one_line(changes, flags, words, slurm_step, tmp_path, capsys):
    slurm_step(**changes)
    rc = train_mnist_mirrored.main(["--strategy", "multiworker", *flags, "--epochs", "1",
                                    "--data-dir", str(tmp_path / "unused"), "--output-dir", str(tmp_path / "out")])
    assert_refused_in_one_line(rc, capsys.readouterr().err, words, tmp_path / "out")


def test_tf_config_wins_over_slurm(slurm_step, tmp_path, monkeypatch, capsys):
    """With TF_CONFIG set, srun's variables are not read: even broken ones do not matter."""
    slurm_step(SLURM_PROCID="broken")
    rc, line = run_under_broken_tf_config(monkeypatch, tmp_path, capsys)
    assert rc == exits.EXIT_BAD_INPUT and "TF_CONFIG" in line and "SLURM" not in line
