"""Real Slurm: deploy/slurm.sbatch sent with sbatch to Debian's own slurmctld and slurmd (tests/slurm_cluster.py).

On one node running two tasks, two jobs in a row share one --output-dir, as a user would send them:
  1. `scancel --signal=TERM` mid-epoch (a pre-emption): every task exits 143 and names where it saved; the job
     ends FAILED 143 for Slurm, or the user, to send again;
  2. sent again, it resumes there; one task's process is SIGKILLed mid-epoch: the batch script reruns the step in
     the same allocation, which resumes at the last backup, and the job ends COMPLETED, not requeued.
Then, each a job of its own: the time limit's warning (`scancel --batch --signal=USR1`, what `--signal=B:USR1@120`
sends) saves, requeues the job by itself and it ends COMPLETED with one restart; bad input on one task ends the job
FAILED at once; a task that keeps dying ends it FAILED after the most restarts. Then two emulated nodes, each in
a network namespace of its own (tests/netns.py), train together.
A job's state comes from `scontrol show job`, each task's exit from srun's lines in the job's output.
"""

import json
import os
import re
import signal
import socket
import sys
import time

import pytest

import netns
import slurm_cluster
from machinery.exits import EXIT_PEER_LOST, EXIT_PREEMPTED
from processes import (EXIT_SECONDS, ROOT, backed_up_images, free_ports, images_at, skip_unless_ci, started,
                       wait_for_backup_after)
from slurm_cluster import Node, SlurmCluster, wait_for_text, watch

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

SCRIPT = "deploy/slurm.sbatch"
BATCH = 8
EPOCH_IMAGES = 1600  # the resume data's training images: on two replicas, 100 steps an epoch
EPOCHS = 2
FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
         "--backup-every-steps", "10"]
# The batch script asks for two nodes of one task; one node runs both tasks here.
ONE_NODE = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1"]
JOB_SECONDS = 300  # a guard against a hang, far above a job's own time
# Inside the two namespaces every port is free: Slurm's own defaults.
SLURMCTLD_PORT, SLURMD_PORT = 6817, 6818

# A task's last line may follow an unfinished progress bar on the same line of the job's output.
LOST = re.compile(r"error: lost worker 1 of this multi-worker run [^\n]*")


def require_slurm():
    reason = slurm_cluster.unavailable()
    if reason:
        skip_unless_ci(reason)


@pytest.fixture(scope="module")
def python_bin(tmp_path_factory):
    """A folder whose `python` is this interpreter, put first on the jobs' PATH (the script runs `python`)."""
    folder = tmp_path_factory.mktemp("python_bin")
    os.symlink(sys.executable, folder / "python")
    return str(folder)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, python_bin):
    require_slurm()
    controller, slurmd = free_ports(2)
    folder = tmp_path_factory.mktemp("slurm_one_node")
    with started(SlurmCluster, folder, [Node("localhost", "127.0.0.1", slurmd)], controller, python_bin) as cluster:
        yield cluster


def submit(cluster, folder, *args, options=(), **env):
    """The batch script with its `args`, its output in `folder`; `env`: variables for the job (MNIST_PYTHON, ...)."""
    return cluster.sbatch(SCRIPT, *args, options=[*options, f"--output={folder}/job-%j.out"], cwd=ROOT,
                          env=cluster.job_env(**env))


def one_epoch(folder, data_dir):
    """The arguments of a job of one epoch on the small data, on ports of its own."""
    base = free_ports(2, consecutive=True)[0]
    return ["--epochs", "1", "--slurm-port-base", str(base), "--data-dir", data_dir, "--output-dir", str(folder / "out")]


def statuses(exits):
    return {task: status for task, (status, _) in exits.items()}


class Chain:
    """The two jobs: {name: (scontrol's fields, output, {task: (status, seconds to srun's report)})}."""

    def __init__(self, cluster, folder, data_dir):
        self.output_dir = str(folder / "out")
        backup_dir = os.path.join(self.output_dir, "backup")
        base = free_ports(2, consecutive=True)[0]
        args = [*FLAGS, "--slurm-port-base", str(base), "--data-dir", data_dir, "--output-dir", self.output_dir]
        self.jobs = {}

        job_id = submit(cluster, folder, *args, options=ONE_NODE)
        wait_for_text(cluster, job_id, f"Epoch 2/{EPOCHS}", JOB_SECONDS)
        sent = time.monotonic()
        cluster.client("scancel", "--signal=TERM", str(job_id))
        self.jobs["term"] = watch(cluster, job_id, sent, EXIT_SECONDS)
        self.saved = images_at(self.jobs["term"][1], "error: pre-empted (SIGTERM)")

        job_id = submit(cluster, folder, *args, options=ONE_NODE)
        wait_for_text(cluster, job_id, "Resuming from the backup", JOB_SECONDS)
        wait_for_backup_after(backup_dir, max(self.saved, default=0),
                              running=lambda: cluster.job(job_id)["JobState"] == "RUNNING")
        sent = time.monotonic()
        os.kill(cluster.task_pids(job_id, cluster.nodes[0])[1], signal.SIGKILL)
        self.killed_after = backed_up_images(backup_dir)
        self.jobs["kill"] = watch(cluster, job_id, sent, JOB_SECONDS)


@pytest.fixture(scope="module")
def chain(one_node, tmp_path_factory, resume_data_dir):
    return Chain(one_node, tmp_path_factory.mktemp("slurm_chain"), resume_data_dir)


def test_term_mid_epoch_ends_every_task_with_143_naming_where_it_saved(chain):
    job, output, exits = chain.jobs["term"]
    print(f"\nscancel --signal=TERM: srun reported {exits} (status, seconds after scancel)")
    assert statuses(exits) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, output[-3000:]
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "143:0" and job["Restarts"] == "0"
    # Both tasks stopped at the same image, inside epoch 2, and say so in their last line.
    assert len(chain.saved) == 2 and len(set(chain.saved)) == 1, output[-3000:]
    assert EPOCH_IMAGES < chain.saved[0] < 2 * EPOCH_IMAGES
    assert "slurm.sbatch: pre-empted: the tasks saved; send the job again to resume" in output
    assert "Traceback" not in output


def test_sent_again_it_resumes_where_it_saved(chain):
    _, output, _ = chain.jobs["kill"]
    # Each task says where it resumed, the first time.
    assert images_at(output, "Resuming from the backup")[:2] == [chain.saved[0]] * 2, output[-3000:]


def test_a_task_killed_mid_epoch_reruns_in_the_allocation_and_the_job_completes(chain):
    job, output, exits = chain.jobs["kill"]
    print(f"\nSIGKILL of task 1: srun reported {exits}; the job {job['JobState']} with {job['Restarts']} requeues")
    assert statuses(exits)[1] in ("Killed", 137), output[-3000:]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "0", output[-3000:]
    assert "restarting it, 1 of 3, from the last backup" in output, output[-3000:]
    # The rerun step resumed, on both tasks, at the backup on disk when the task was killed, or a later one.
    resumed = images_at(output, "Resuming from the backup")[2:]
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= chain.killed_after, output[-3000:]
    with open(os.path.join(chain.output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["replicas"] == 2 and results["strategy"] == "multiworker"
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * EPOCH_IMAGES
    assert "Traceback" not in output


# ---------------------------------------------------------------- the time limit, bad input, a task that dies

def test_the_time_limit_s_warning_saves_and_requeues_the_job_which_completes(one_node, tmp_path, resume_data_dir):
    output_dir = str(tmp_path / "out")
    base = free_ports(2, consecutive=True)[0]
    job_id = submit(one_node, tmp_path, *FLAGS, "--slurm-port-base", str(base), "--data-dir", resume_data_dir,
                    "--output-dir", output_dir, options=ONE_NODE)
    wait_for_text(one_node, job_id, f"Epoch 2/{EPOCHS}", JOB_SECONDS)
    sent = time.monotonic()
    one_node.client("scancel", "--batch", "--signal=USR1", str(job_id))
    one_node.wait_for_state(job_id, {"PENDING", "REQUEUED", "COMPLETED", *slurm_cluster.FINAL_STATES}, EXIT_SECONDS)
    job, output, _ = watch(one_node, job_id, sent, JOB_SECONDS + slurm_cluster.CRED_EXPIRE_SECONDS)
    seconds = time.monotonic() - sent
    print(f"\nthe time limit's warning: the job {job['JobState']} after {job['Restarts']} requeue, "
          f"{seconds:.0f} s after the signal")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "1", output[-3000:]
    saved = images_at(output, "error: pre-empted (SIGTERM)")
    assert len(saved) == 2 and len(set(saved)) == 1, output[-3000:]
    assert "requeueing (requeue 1 of 5)" in output
    assert images_at(output, "Resuming from the backup") == saved, output[-3000:]
    with open(os.path.join(output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["resumed_after_images"] == saved[0] > 0
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * EPOCH_IMAGES


def _python_that(folder, task1):
    """A stand-in for MNIST_PYTHON: `python` as it is on task 0; on task 1 `task1`'s shell lines come first."""
    path = folder / "python-task1"
    path.write_text(f'#!/bin/bash\nif [ "$SLURM_PROCID" = 1 ]; then\n{task1}\nfi\nexec python "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_bad_input_on_one_task_fails_the_job_at_once_without_a_retry(one_node, tmp_path, data_dir):
    # Task 1 gets --epochs 0; task 0 waits for it at the cluster's start, until the step is ended.
    python = _python_that(tmp_path, 'exec python "$@" --epochs 0')
    job_id = submit(one_node, tmp_path, *one_epoch(tmp_path, data_dir), options=ONE_NODE, MNIST_PYTHON=python)
    sent = time.monotonic()
    job, output, exits = watch(one_node, job_id, sent, EXIT_SECONDS)
    print(f"\nbad input on task 1: srun reported {exits}; the job {job['JobState']} {job['ExitCode']} "
          f"{time.monotonic() - sent:.1f} s after sbatch")
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0" and job["Restarts"] == "0", output[-3000:]
    # The bad input's line once (no retry); task 0, ended by the step's SIGTERM while it waited, says only that.
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors.count("error: --epochs must be at least 1, got 0") == 1, output[-3000:]
    assert all(line.startswith("error: pre-empted (SIGTERM)") for line in errors if "--epochs" not in line), output
    assert "a task exited 2, which a restart cannot mend" in output and "restarting it" not in output
    assert "Traceback" not in output


def test_a_task_that_keeps_dying_fails_the_job_after_the_most_restarts(one_node, tmp_path, data_dir):
    python = _python_that(tmp_path, "kill -KILL $$")
    job_id = submit(one_node, tmp_path, *one_epoch(tmp_path, data_dir), options=ONE_NODE, MNIST_PYTHON=python,
                    MNIST_MAX_RESTARTS="2")
    job, output, _ = watch(one_node, job_id, time.monotonic(), JOB_SECONDS)
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", output[-3000:]
    assert output.count("(a task lost); restarting it") == 2, output[-3000:]
    assert "the step was restarted 2 times in this allocation (MNIST_MAX_RESTARTS); giving up" in output


# ---------------------------------------------------------------- a port already taken

# Seconds task 1 waits for task 0, which never comes: short, so that the test is.
CLUSTER_TIMEOUT = 15


def test_first_tasks_port_taken_ends_the_step_at_once_and_the_job_after_its_restarts(one_node, tmp_path, data_dir):
    base = free_ports(2, consecutive=True)[0]
    args = ["--epochs", "1", "--steps-per-epoch", "2", "--slurm-port-base", str(base), "--cluster-timeout",
            str(CLUSTER_TIMEOUT), "--data-dir", data_dir, "--output-dir", str(tmp_path / "out")]
    # Another program on the node holds task 0's port (bound; it accepts no connections).
    with socket.socket() as taken:
        taken.bind(("", base))
        job_id = submit(one_node, tmp_path, *args, options=ONE_NODE, MNIST_MAX_RESTARTS="1")
        sent = time.monotonic()
        try:
            job, output, exits = watch(one_node, job_id, sent, EXIT_SECONDS + CLUSTER_TIMEOUT, fail_on="Traceback")
        finally:
            one_node.client("scancel", "--full", "--signal=KILL", str(job_id), check=False)
    print(f"\nport {base} taken: srun reported {exits} (status, seconds after sbatch); the job {job['JobState']} "
          f"{job['ExitCode']} after {time.monotonic() - sent:.1f} s")
    # Task 0 exits with the retryable status, and the step ends at once: task 1 does not wait out
    # --cluster-timeout for it. The step is rerun once (MNIST_MAX_RESTARTS), which meets the same port.
    assert statuses(exits) == {0: EXIT_PEER_LOST, 1: EXIT_PREEMPTED}, output[-3000:]
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "138:0", output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    taken_lines = [line for line in errors if f"port {base}" in line]
    assert len(taken_lines) == 2 and all(line.startswith("error: worker 0 ") for line in taken_lines), output
    assert "--slurm-port-base" in taken_lines[0]
    assert all(line.startswith("error: pre-empted (SIGTERM)") for line in errors if line not in taken_lines)
    assert "restarting it, 1 of 1" in output and "restarted 1 times in this allocation" in output


# ---------------------------------------------------------------- two nodes

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, python_bin):
    require_slurm()
    reason = netns.unavailable()
    if reason:
        skip_unless_ci(reason)
    folder = tmp_path_factory.mktemp("slurm_two_nodes")
    with started(netns.Hosts, f"slurm{os.getpid()}", str(folder), hostnames=["tnode1", "tnode2"]) as hosts:
        nodes = [Node(name, address, SLURMD_PORT, hosts.run_in(i))
                 for i, (name, address) in enumerate(zip(hosts.hostnames, hosts.addresses))]
        with started(SlurmCluster, folder / "cluster", nodes, SLURMCTLD_PORT, python_bin) as cluster:
            yield cluster


def test_two_nodes_train_together(two_nodes, tmp_path, data_dir):
    """The batch script as written: two nodes, one task each, both listening on the same port of their host."""
    output_dir = str(tmp_path / "out")
    job_id = submit(two_nodes, tmp_path, "--epochs", "1", "--steps-per-epoch", "5", "--batch-size-per-replica",
                    str(BATCH), "--data-dir", data_dir, "--output-dir", output_dir)
    job, output, exits = watch(two_nodes, job_id, time.monotonic(), JOB_SECONDS)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-3000:]
    assert job["NodeList"] == "tnode[1-2]" and exits == {}
    with open(os.path.join(output_dir, "results.json")) as f:
        assert json.load(f)["replicas"] == 2
    ports = dict(re.findall(r"^warning: worker (\d) listens on port (\d+) ", output, re.M))
    assert set(ports) == {"0", "1"} and ports["0"] == ports["1"], output[-3000:]
