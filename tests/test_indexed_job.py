"""A Kubernetes Indexed Job's workers, as deploy/indexed-job.yaml describes them: no TF_CONFIG.

Each pod is a host of its own: a network namespace (tests/netns.py), and a mount and UTS namespace in which its
host name is the one the Job controller gives it, `<job>-<index>`, and every pod's `<job>-<index>.<service>`
resolves through a hosts file mounted over /etc/hosts, as the cluster's DNS would resolve it. Each pod gets
JOB_COMPLETION_INDEX, as the Job controller sets it, and the manifest's own variables and command. A pod SIGKILLed
mid-epoch ends the other with 138; both started again with the same indexes, as the Job replaces them, resume at
the last backup and train to the end, every image once. Bad variables are refused in one line, exit 2, before
TensorFlow starts.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

import config
import netns
import train_mnist_mirrored
from conftest import (ROOT, Worker, apply_env, assert_one_port_warning, assert_refused_in_one_line, backed_up_images,
                      finish, images_at, run_under_broken_tf_config, skip_unless_ci, started, subprocess_env,
                      wait_for_backup_after)

MANIFEST = os.path.join(ROOT, "deploy", "indexed-job.yaml")
ENTRYPOINT = ["python", "train_mnist_mirrored.py"]
BATCH = 8
EPOCH_IMAGES = 1600  # the resume data's training images: on two replicas, 100 steps an epoch
EPOCHS = 2
FLAGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
         "--backup-every-steps", "10"]
RUN_SECONDS = 300  # a guard against a hang
# Runs "$@" as a pod: its hosts file ($1) mounted over /etc/hosts and its host name ($2), both in namespaces of
# its own, on its network ($3). The program keeps the PID of the command (each step execs the next).
POD = ('mount --bind "$1" /etc/hosts && hostname "$2" && net="$3" && shift 3 && '
       'exec nsenter --net="$net" -- "$@"')


def manifest():
    """(the Job's name, the Service's, the trainer's variables, its command's options) from the manifest."""
    with open(MANIFEST) as f:
        docs = {doc["kind"]: doc for doc in yaml.safe_load_all(f)}
    container, = docs["Job"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ENTRYPOINT
    env = {var["name"]: var["value"] for var in container["env"]}
    return docs["Job"]["metadata"]["name"], docs["Service"]["metadata"]["name"], env, container["command"][2:]


JOB, SERVICE, ENV, COMMAND = manifest()
WORKERS = int(ENV["MNIST_WORKERS"])


def option(name):
    return COMMAND[COMMAND.index(name) + 1]


class Pods:
    """The Job's pods, one per index, on the hosts of `hosts`; `start` makes them, as the Job does."""

    def __init__(self, hosts, folder, data_dir):
        self.hosts, self.folder = hosts, folder
        self.output_dir = str(folder / "out")
        # The manifest's command, with this machine's data dir and output dir for its volume's.
        self.args = [*COMMAND, *FLAGS, "--data-dir", data_dir, "--output-dir", self.output_dir]
        self.args.remove("--idx-dir")
        self.args.remove(option("--idx-dir"))

    def start(self, attempt):
        return [Worker(self.args, {**ENV, "JOB_COMPLETION_INDEX": str(index)}, self.folder, f"pod{index}-{attempt}",
                       run_in=["unshare", "--mount", "--uts", "--", "sh", "-c", POD, "sh", self.hosts.hosts_file,
                               f"{JOB}-{index}", f"/run/netns/{self.hosts.names[index]}"])
                for index in range(WORKERS)]


class Restart:
    def __init__(self, pods):
        backup_dir = os.path.join(pods.output_dir, "backup")
        self.output_dir = pods.output_dir
        self.first = pods.start(1)
        try:
            # Mid-epoch: a backup inside epoch 1 is on disk.
            wait_for_backup_after(backup_dir, 0, running=lambda: all(p.proc.poll() is None for p in self.first))
            self.first[1].proc.kill()
            killed = time.monotonic()
            self.statuses = finish(self.first, RUN_SECONDS)
            self.survivor_seconds = round(time.monotonic() - killed, 2)
        finally:
            for pod in self.first:
                pod.proc.kill()
        self.last_backup = backed_up_images(backup_dir)
        self.finished_early = os.path.exists(os.path.join(self.output_dir, "results.json"))
        # The Job replaces both pods, with the same indexes: the one killed (137) and the one that exited 138.
        restarted = time.monotonic()
        self.again = pods.start(2)
        self.again_statuses = finish(self.again, RUN_SECONDS)
        self.again_seconds = round(time.monotonic() - restarted, 1)


@pytest.fixture(scope="module")
def restart(tmp_path_factory, resume_data_dir):
    reason = netns.unavailable() or (None if shutil.which("hostname") else "hostname not installed")
    if reason:
        skip_unless_ci(reason)
    folder = tmp_path_factory.mktemp("indexed_job")
    hostnames = [ENV["MNIST_WORKER_HOST"].replace("{index}", str(i)) for i in range(WORKERS)]
    with started(netns.Hosts, f"job{os.getpid()}", str(folder), hostnames) as hosts:
        return Restart(Pods(hosts, folder, resume_data_dir))


@pytest.mark.slow
def test_a_pod_killed_mid_epoch_ends_the_other_with_138_and_one_line(restart):
    print(f"\npod 1 SIGKILLed after image {restart.last_backup:,} was backed up: pod 0 exited "
          f"{restart.statuses[0]} {restart.survivor_seconds} s later; both replaced, they finished in "
          f"{restart.again_seconds} s")
    assert restart.statuses[1] == -9
    pod0 = restart.first[0]
    assert restart.statuses[0] == config.EXIT_PEER_LOST, pod0.stderr[-3000:]
    assert "Traceback" not in pod0.stderr
    last = pod0.last_stderr_line
    assert last.startswith("error: lost worker 1 ") and "restart every worker with the same command" in last, last
    assert 0 < restart.last_backup < EPOCH_IMAGES  # the kill came inside epoch 1
    assert not restart.finished_early


@pytest.mark.slow
def test_both_pods_replaced_with_their_indexes_resume_and_train_every_image_once(restart):
    for pod, status in zip(restart.again, restart.again_statuses):
        assert status == 0, pod.stderr[-3000:]
        # Each found the cluster from the Job's variables, listening on the manifest's port.
        assert_one_port_warning(pod.stderr, port=int(ENV["MNIST_WORKER_PORT"]))
        assert images_at(pod.stdout, "Resuming from the backup") == [restart.last_backup]
    with open(os.path.join(restart.output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["strategy"] == "multiworker" and results["replicas"] == WORKERS
    assert results["resumed_after_images"] == restart.last_backup
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * EPOCH_IMAGES


# ---------------------------------------------------------------- bad variables: exit 2, one line

@pytest.fixture
def pod_env(monkeypatch):
    """The manifest's variables for pod 1, in this process, with no TF_CONFIG and no Slurm."""
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith("SLURM_"):
            monkeypatch.delenv(name)

    def enter(**changes):
        apply_env(monkeypatch, {**ENV, "JOB_COMPLETION_INDEX": "1", **changes})
    return enter


@pytest.mark.parametrize("changes, words", [
    ({"JOB_COMPLETION_INDEX": None}, ["JOB_COMPLETION_INDEX not set", "Indexed Job"]),
    ({"MNIST_WORKERS": None, "MNIST_WORKER_HOST": None}, ["MNIST_WORKERS, MNIST_WORKER_HOST not set"]),
    ({"MNIST_WORKERS": "two"}, ["MNIST_WORKERS='two'", "whole number"]),
    ({"JOB_COMPLETION_INDEX": "2"}, ["JOB_COMPLETION_INDEX=2", "MNIST_WORKERS=2"]),
    ({"MNIST_WORKER_PORT": "70000"}, ["MNIST_WORKER_PORT=70000", "1-65535"]),
    ({"MNIST_WORKER_HOST": "mnist-mirrored-0.workers"}, ["MNIST_WORKER_HOST", "{index}"]),
    ({"MNIST_WORKER_HOST": "Mnist_{index}.workers"}, ["MNIST_WORKER_HOST", "host name"]),
    # With srun's variables too, the Indexed Job's are read (a broken SLURM_PROCID would be named otherwise).
    ({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "broken", "MNIST_WORKER_HOST": "x"}, ["MNIST_WORKER_HOST='x'"]),
], ids=["no-index", "no-count-or-host", "count-not-a-number", "index-too-big", "port-too-big", "host-without-index",
        "host-not-a-dns-name", "wins-over-slurm"])
def test_bad_pod_variables_are_refused_in_one_line(changes, words, pod_env, tmp_path, capsys):
    pod_env(**changes)
    rc = train_mnist_mirrored.main(["--strategy", "multiworker", "--output-dir", str(tmp_path / "out")])
    line = assert_refused_in_one_line(rc, capsys.readouterr().err, words, tmp_path / "out")
    assert "SLURM" not in line


def test_tf_config_wins_over_the_pod_variables(pod_env, monkeypatch, tmp_path, capsys):
    pod_env(MNIST_WORKERS="broken")
    rc, line = run_under_broken_tf_config(monkeypatch, tmp_path, capsys)
    assert rc == config.EXIT_BAD_INPUT and "TF_CONFIG" in line and "MNIST_WORKERS" not in line


@pytest.mark.slow
def test_a_host_pattern_naming_another_job_is_refused_in_the_pod(tmp_path):
    """In a pod whose host name is the Job's `<job>-<index>`, a pattern naming another job (a Job renamed, its
    variable not) would leave every worker waiting for pods that never come: it is refused at once."""
    reason = netns.unavailable() or (None if shutil.which("hostname") else "hostname not installed")
    if reason:
        skip_unless_ci(reason)
    env = {**subprocess_env(), **ENV, "JOB_COMPLETION_INDEX": "1",
           "MNIST_WORKER_HOST": ENV["MNIST_WORKER_HOST"].replace(JOB, "old-name")}
    proc = subprocess.run(["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
                           f"{JOB}-1", sys.executable, *ENTRYPOINT[1:], "--strategy", "multiworker",
                           "--output-dir", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == config.EXIT_BAD_INPUT
    assert len(lines) == 1 and lines[0].startswith("error: MNIST_WORKER_HOST="), lines
    assert "names this pod old-name-1." in lines[0] and f"its host name is {JOB}-1" in lines[0], lines[0]
