"""Workers on separate hosts: two network namespaces joined by a veth pair (tests/netns.py), so TensorFlow's
gRPC crosses a real interface. A partition (one side's link taken down mid-epoch) ends both workers with 138
and one line, within TensorFlow's heartbeat timeout; both restarted resume at the last backup, together.
"""

import json
import os
import time

import pytest

from machinery import exits
import netns
from processes import EXIT_SECONDS, Worker, backed_up_images, images_at, skip_unless_ci, started, wait_for_backup_after

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

BATCH = 8
EPOCH_IMAGES = 1600  # the resume data's training images: on two replicas, 100 steps an epoch
EPOCHS = 2
FLAGS = ["--strategy", "multiworker", "--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH),
         "--steps-per-execution", "5", "--backup-every-steps", "10"]
# Inside the two namespaces every port is free: TFJob's default.
PORT = 2222
# TensorFlow's coordination service declares a task lost when its heartbeats stop for this long
# (kDefaultHeartbeatTimeoutMs; MultiWorkerMirroredStrategy leaves it at its default).
HEARTBEAT_SECONDS = 10
# The bound asserted: the timeout, the service's check of it and a loaded machine's slack. The measured time
# is printed (pytest -s).
PARTITION_EXIT_SECONDS = 2 * HEARTBEAT_SECONDS
RUN_SECONDS = 300  # a guard against a hang


def start_workers(hosts, args, folder, attempt):
    """Worker i on host i, each told the cluster of both hosts' addresses."""
    cluster = {"worker": [f"{address}:{PORT}" for address in hosts.addresses]}
    return [Worker(args, {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})},
                   folder, f"worker{i}-{attempt}", run_in=hosts.run_in(i)) for i in range(2)]


def wait_for_ends(workers, timeout, since):
    """{worker: (exit status, seconds from `since`)} once every worker has exited; kills them all after `timeout`."""
    ends = {}
    try:
        while len(ends) < len(workers):
            for i, w in enumerate(workers):
                if i not in ends and w.proc.poll() is not None:
                    ends[i] = (w.proc.returncode, round(time.monotonic() - since, 2))
            assert time.monotonic() - since < timeout, f"still running after {timeout} s: {ends}"
            time.sleep(0.05)
    finally:
        for w in workers:
            w.proc.kill()
            w.proc.wait(timeout=EXIT_SECONDS)
    return ends


class Partition:
    def __init__(self, hosts, folder, data_dir):
        self.output_dir = str(folder / "out")
        backup_dir = os.path.join(self.output_dir, "backup")
        args = [*FLAGS, "--data-dir", data_dir, "--output-dir", self.output_dir]

        self.first = start_workers(hosts, args, folder, 1)
        try:
            # Mid-epoch: a backup inside epoch 2 is on disk.
            wait_for_backup_after(backup_dir, EPOCH_IMAGES,
                                  running=lambda: all(w.proc.poll() is None for w in self.first))
            hosts.link(1, "down")
            self.ends = wait_for_ends(self.first, RUN_SECONDS, since=time.monotonic())
        finally:
            for w in self.first:
                w.proc.kill()
                w.proc.wait(timeout=EXIT_SECONDS)
        self.last_backup = backed_up_images(backup_dir)
        self.finished_early = os.path.exists(os.path.join(self.output_dir, "results.json"))

        hosts.link(1, "up")
        self.again = start_workers(hosts, args, folder, 2)
        self.again_ends = wait_for_ends(self.again, RUN_SECONDS, since=time.monotonic())


@pytest.fixture(scope="module")
def partition(tmp_path_factory, resume_data_dir):
    reason = netns.unavailable()
    if reason:
        skip_unless_ci(reason)
    folder = tmp_path_factory.mktemp("separate_hosts")
    with started(netns.Hosts, f"hosts{os.getpid()}", str(folder)) as hosts:
        return Partition(hosts, folder, resume_data_dir)


def test_a_partition_ends_both_workers_with_138_and_one_line_within_the_heartbeat_timeout(partition):
    print(f"\nworker 1's link down: (exit status, seconds after) {partition.ends}")
    for index, (status, seconds) in partition.ends.items():
        worker = partition.first[index]
        assert status == exits.EXIT_PEER_LOST, worker.stderr[-3000:]
        assert seconds < PARTITION_EXIT_SECONDS, partition.ends
        assert "Traceback" not in worker.stderr
        last = worker.last_stderr_line
        assert last.startswith("error: lost ") and "restart every worker with the same command" in last, last
    # Worker 0 names the worker it lost.
    assert partition.first[0].last_stderr_line.startswith("error: lost worker 1 ")
    assert not partition.finished_early


def test_both_restarted_resume_at_the_last_backup_and_finish_together(partition):
    for index, (status, _) in partition.again_ends.items():
        assert status == 0, partition.again[index].stderr[-3000:]
    with open(os.path.join(partition.output_dir, "results.json")) as f:
        results = json.load(f)
    assert results["replicas"] == 2
    assert results["resumed_after_images"] == partition.last_backup > EPOCH_IMAGES
    for worker in partition.again:
        assert images_at(worker.stdout, "Resuming from the backup") == [partition.last_backup]
