"""Launching from schedulers: Slurm's srun and a shared data dir, Kubeflow's TFJob and a lost worker (exit 138)."""

import json
import os
import signal
import sys

import pytest

import config
import worker_group
import terminal
import train_mnist_mirrored
from conftest import (Worker, apply_env, assert_one_port_warning, assert_refused_in_one_line, finish, free_ports,
                      run_under_broken_tf_config, smoke_args)

CHIEF_OUTPUTS = ["logs", "model.keras", "results.json", "saved_model", "training_checkpoints"]


def _results(output_dir):
    with open(os.path.join(output_dir, "results.json")) as f:
        return json.load(f)


def _worker_folders(scratch):
    """A non-chief's own output folder under its TMPDIR (tfds leaves empty tmp*tfds folders there when offline)."""
    return [name for name in os.listdir(scratch) if name.startswith("mnist-worker-")]


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


def test_two_slurm_tasks_prepare_one_shared_data_dir_and_task_0_writes_outputs(tmp_path, idx_dir):
    """Two tasks of one node, as srun starts them, given the IDX files and one fresh data dir (shared storage)."""
    base = free_ports(2, consecutive=True)[0]
    shared, output_dir = tmp_path / "shared_tfds", str(tmp_path / "out")
    args = ["--strategy", "multiworker", "--slurm-port-base", str(base), "--idx-dir", idx_dir,
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
    # Task 0 is the chief: only its outputs are in --output-dir; task 1 removed its temporary copies.
    assert sorted(os.listdir(output_dir)) == CHIEF_OUTPUTS
    assert _worker_folders(tmp_path / "task1") == []
    # One task prepared the data while the other waited for its lock (or found it done): one copy, no leftovers.
    preparers = [w for w in workers if any(line.startswith("preparing mnist in") for line in w.stdout.splitlines())]
    assert len(preparers) == 1
    assert os.listdir(shared / "mnist") == ["3.0.1"]


# ---------------------------------------------------------------- Kubernetes: a TFJob that loses a worker

EPOCHS = 4
# Short epochs of single steps, so that a worker is killed inside epoch 3 (or soon after: it still is lost).
LOST_FLAGS = ["--epochs", str(EPOCHS), "--steps-per-epoch", "10", "--batch-size-per-replica", "4",
              "--steps-per-execution", "1"]


def tfjob_env(cluster, task_type):
    """TF_CONFIG as Kubeflow's training operator writes it for a TFJob with a chief and one worker."""
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0},
                                     "environment": "cloud"})}


def test_tfjob_worker_lost_exits_138_and_restart_resumes(tmp_path, data_dir):
    chief_port, worker_port = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    output_dir = str(tmp_path / "out")
    args = ["--strategy", "multiworker", *LOST_FLAGS, "--data-dir", data_dir, "--output-dir", output_dir]

    def start(attempt):
        return [Worker(args, tfjob_env(cluster, task), tmp_path, f"{task}{attempt}") for task in ("chief", "worker")]

    chief, worker = start(1)
    try:
        chief.wait_for(f"Epoch 3/{EPOCHS}")  # epochs 1 and 2 are backed up
        worker.proc.send_signal(signal.SIGKILL)
        status = chief.proc.wait(timeout=300)  # a guard against a hang; the survivor takes seconds
    finally:
        finish([chief, worker])
    assert status == config.EXIT_PEER_LOST, chief.stderr[-3000:]
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
    # The chief wrote the outputs; the worker wrote only to its own temporary folder, and removed it.
    assert sorted(os.listdir(output_dir)) == CHIEF_OUTPUTS
    assert _worker_folders(tmp_path / "worker2") == []


def test_lost_peer_is_named_only_for_multiworker_collective_failures():
    import tensorflow as tf

    reset = ("Collective ops is aborted by: Socket closed\nAdditional GRPC error information from remote target "
             "/job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:")
    multi, single = config.Config(strategy="multiworker"), config.Config()
    assert worker_group.lost_peer(multi, tf.errors.UnavailableError(None, None, reset)) == (
        "lost worker 1 of this multi-worker run (Socket closed)")
    leader = "Collective ops is aborted by: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat"
    assert "coordination service" in worker_group.lost_peer(
        multi, tf.errors.DeadlineExceededError(None, None, leader))
    # Other errors keep their own status and traceback: only a multi-worker run loses peers.
    assert worker_group.lost_peer(single, tf.errors.UnavailableError(None, None, reset)) is None
    assert worker_group.lost_peer(multi, tf.errors.InvalidArgumentError(None, None, reset)) is None
    assert worker_group.lost_peer(multi, ValueError(reset)) is None


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
    assert rc == config.EXIT_BAD_INPUT and "TF_CONFIG" in line and "SLURM" not in line
