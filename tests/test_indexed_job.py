"""The workers of a Kubernetes Indexed Job (deploy/indexed-job.yaml) and of a Kubeflow TrainJob on its runtime
(deploy/trainjob.yaml): no TF_CONFIG.

Each pod is a host of its own: a network namespace (tests/netns.py), and a mount and UTS namespace in which its
host name is the one its controller gives it (`<job>-<index>`; `<trainjob>-node-0-<index>` for the JobSet Trainer
makes), and every pod's name under its headless Service resolves through a hosts file mounted over /etc/hosts, as
the cluster's DNS would resolve it. Each pod gets JOB_COMPLETION_INDEX, as the Job controller sets it, and the
manifest's own variables and command (for the TrainJob, as Trainer applies it to its runtime). The TrainJob's pods
train to the end. One of the Indexed Job's pods SIGKILLed mid-epoch ends the other with 138; both started again
with the same indexes, as the Job (or JobSet) replaces them, resume at the last backup and train to the end, every
image once. Bad variables are refused in one line, exit 2, before TensorFlow starts.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from machinery import exits, worker_sources
import netns
import train_mnist_mirrored
from manifests import job_specs, trainer
from processes import (ROOT, Worker, apply_env, assert_one_port_warning, assert_refused_in_one_line, backed_up_images,
                       finish, images_at, run_under_broken_tf_config, skip_unless_ci, started, subprocess_env,
                       wait_for_backup_after)
from small_data import NUM_TRAIN

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


class Manifest:
    """A manifest's pods: their variables and command's options, each one's host name and the name the others
    reach it by (`<host>.<subdomain>`)."""

    def __init__(self, spec, host, subdomain):
        container = trainer(spec)
        assert container["command"][:2] == ENTRYPOINT
        self.env = {var["name"]: var["value"] for var in container["env"]}
        self.command = container["command"][2:]
        self.workers = spec["completions"]
        self.hosts = [host.format(index=i) for i in range(self.workers)]
        self.names = [f"{h}.{subdomain}" for h in self.hosts]

    def option(self, name):
        return self.command[self.command.index(name) + 1]


MANIFESTS = {name: Manifest(spec, host, subdomain) for name, spec, host, subdomain in job_specs()
             if name in ("indexed-job", "trainjob")}
INDEXED = MANIFESTS["indexed-job"]
JOB, ENV = INDEXED.hosts[0].rsplit("-", 1)[0], INDEXED.env


class Pods:
    """The pods of `manifest`, one per index, on the hosts of `hosts`; `start` makes them, as the Job does."""

    def __init__(self, manifest, hosts, folder, data_dir):
        self.manifest, self.hosts, self.folder = manifest, hosts, folder
        self.output_dir = str(folder / "out")
        # The manifest's command, with this machine's data dir and output dir for its volume's.
        self.args = [*manifest.command, *FLAGS, "--data-dir", data_dir, "--output-dir", self.output_dir]
        self.args.remove("--idx-dir")
        self.args.remove(manifest.option("--idx-dir"))

    def start(self, attempt):
        return [Worker(self.args, {**self.manifest.env, "JOB_COMPLETION_INDEX": str(index)}, self.folder,
                       f"pod{index}-{attempt}",
                       run_in=["unshare", "--mount", "--uts", "--", "sh", "-c", POD, "sh", self.hosts.hosts_file,
                               self.manifest.hosts[index], f"/run/netns/{self.hosts.names[index]}"])
                for index in range(self.manifest.workers)]


class Restart:
    def __init__(self, pods):
        backup_dir = os.path.join(pods.output_dir, "backup")
        self.manifest, self.output_dir = pods.manifest, pods.output_dir
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
        # The Job (or JobSet) replaces both pods, with the same indexes: the one killed (137) and the one that
        # exited 138.
        restarted = time.monotonic()
        self.again = pods.start(2)
        self.again_statuses = finish(self.again, RUN_SECONDS)
        self.again_seconds = round(time.monotonic() - restarted, 1)


def on_their_hosts(name, tmp_path_factory, data_dir, run):
    """run(Pods) for the manifest `name`, its pods' hosts up meanwhile; returns what it returns."""
    reason = netns.unavailable() or (None if shutil.which("hostname") else "hostname not installed")
    if reason:
        skip_unless_ci(reason)
    manifest = MANIFESTS[name]
    folder = tmp_path_factory.mktemp(name)
    with started(netns.Hosts, f"{name[:3]}{os.getpid()}", str(folder), manifest.names) as hosts:
        return run(Pods(manifest, hosts, folder, data_dir))


@pytest.fixture(scope="module")
def restart(tmp_path_factory, resume_data_dir):
    """The Indexed Job's pods, one SIGKILLed mid-epoch and both replaced."""
    return on_their_hosts("indexed-job", tmp_path_factory, resume_data_dir, Restart)


@pytest.mark.slow
def test_a_pod_killed_mid_epoch_ends_the_other_with_138_and_one_line(restart):
    print(f"\npod 1 SIGKILLed after image {restart.last_backup:,} was backed up: pod 0 exited "
          f"{restart.statuses[0]} {restart.survivor_seconds} s later; both replaced, they finished in "
          f"{restart.again_seconds} s")
    assert restart.statuses[1] == -9
    pod0 = restart.first[0]
    assert restart.statuses[0] == exits.EXIT_PEER_LOST, pod0.stderr[-3000:]
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
        assert_one_port_warning(pod.stderr, port=int(restart.manifest.env["MNIST_WORKER_PORT"]))
        assert images_at(pod.stdout, "Resuming from the backup") == [restart.last_backup]
    with open(os.path.join(restart.output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["strategy"] == "multiworker" and results["replicas"] == restart.manifest.workers
    assert results["resumed_after_images"] == restart.last_backup
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * EPOCH_IMAGES


@pytest.mark.slow
def test_a_trainjobs_pods_find_each_other_and_train_to_the_end(tmp_path_factory, data_dir):
    """By the host names JobSet gives them, with the variables Trainer applies to its runtime. A lost pod is the
    Indexed Job's case above: JobSet, as the Job, replaces the pods with the same indexes."""
    def to_the_end(pods):
        workers = pods.start(1)
        return workers, finish(workers, RUN_SECONDS), pods.output_dir

    manifest = MANIFESTS["trainjob"]
    workers, statuses, output_dir = on_their_hosts("trainjob", tmp_path_factory, data_dir, to_the_end)
    for pod, status in zip(workers, statuses):
        assert status == 0, pod.stderr[-3000:]
        assert "Traceback" not in pod.stderr
        assert_one_port_warning(pod.stderr, port=int(manifest.env["MNIST_WORKER_PORT"]))
    with open(os.path.join(output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["strategy"] == "multiworker" and results["replicas"] == manifest.workers
    assert results["resumed_after_images"] == 0 and results["train_images"] == EPOCHS * NUM_TRAIN


# ---------------------------------------------------------------- bad variables: exit 2, one line

@pytest.fixture
def pod_env(monkeypatch):
    """A manifest's variables for pod 1 (the Indexed Job's unless told), in this process, with no TF_CONFIG and no
    Slurm."""
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(("SLURM_", "MNIST_")):
            monkeypatch.delenv(name)

    def enter(manifest=INDEXED, **changes):
        apply_env(monkeypatch, {**manifest.env, "JOB_COMPLETION_INDEX": "1", **changes})
    return enter


def refused_in_one_line(words, tmp_path, capsys):
    rc = train_mnist_mirrored.main(["--strategy", "multiworker", "--output-dir", str(tmp_path / "out")])
    return assert_refused_in_one_line(rc, capsys.readouterr().err, words, tmp_path / "out")


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
    assert "SLURM" not in refused_in_one_line(words, tmp_path, capsys)


@pytest.mark.parametrize("changes, words", [
    ({"MNIST_WORKERS": None}, ["MNIST_WORKERS not set", "TrainJob's pod", "deploy/trainjob.yaml"]),
    ({"JOB_COMPLETION_INDEX": "2"}, ["JOB_COMPLETION_INDEX=2", "MNIST_WORKERS=2", "numNodes"]),
    ({"MNIST_TRAINJOB": "Mnist_Job"}, ["MNIST_TRAINJOB='Mnist_Job'", worker_sources.TRAINJOB_NAME_LABEL]),
    # An Indexed Job's variable beside the TrainJob's: the TrainJob's are read (the host pattern is not).
    ({"MNIST_WORKER_HOST": "x", "MNIST_WORKER_PORT": "0"}, ["MNIST_WORKER_PORT=0", "deploy/trainjob.yaml"]),
], ids=["no-count", "index-too-big", "name-not-a-dns-label", "wins-over-the-indexed-job"])
def test_bad_trainjob_variables_are_refused_in_one_line(changes, words, pod_env, tmp_path, capsys):
    pod_env(MANIFESTS["trainjob"], **changes)
    assert "MNIST_WORKER_HOST" not in refused_in_one_line(words, tmp_path, capsys)


def test_tf_config_wins_over_the_pod_variables(pod_env, monkeypatch, tmp_path, capsys):
    pod_env(MNIST_WORKERS="broken")
    rc, line = run_under_broken_tf_config(monkeypatch, tmp_path, capsys)
    assert rc == exits.EXIT_BAD_INPUT and "TF_CONFIG" in line and "MNIST_WORKERS" not in line


@pytest.mark.slow
@pytest.mark.parametrize("name, variable, old", [
    ("indexed-job", "MNIST_WORKER_HOST", lambda env: env["MNIST_WORKER_HOST"].replace(JOB, "old-name")),
    ("trainjob", "MNIST_TRAINJOB", lambda env: "old-name"),
])
def test_variables_naming_another_job_are_refused_in_the_pod(name, variable, old, tmp_path):
    """In a pod whose host name is the one its controller gives it, variables naming another job (a Job renamed,
    its variable not; a runtime whose replicated job is not `node`) would leave every worker waiting for pods that
    never come: it is refused at once."""
    reason = netns.unavailable() or (None if shutil.which("hostname") else "hostname not installed")
    if reason:
        skip_unless_ci(reason)
    manifest = MANIFESTS[name]
    env = {**subprocess_env(), **manifest.env, "JOB_COMPLETION_INDEX": "1", variable: old(manifest.env)}
    own = manifest.hosts[1]
    proc = subprocess.run(["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
                           own, sys.executable, *ENTRYPOINT[1:], "--strategy", "multiworker",
                           "--output-dir", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == exits.EXIT_BAD_INPUT
    assert len(lines) == 1 and lines[0].startswith(f"error: {variable}="), lines
    named = own.replace(JOB if name == "indexed-job" else own.split("-node-")[0], "old-name")
    assert f"names this pod {named}." in lines[0] and f"its host name is {own};" in lines[0], lines[0]
