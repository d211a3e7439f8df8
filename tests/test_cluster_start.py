"""A multi-worker cluster never hangs at start, and its workers leave together.

Real processes on loopback: a worker whose peer never comes exits 138 within --cluster-timeout naming it; a taken
port is one line; SIGTERM during the wait is 143 within seconds; a successful two-worker run (a ring, all-reducing
in bfloat16, validating) logs no errors but each its open port, records its choices, leaves only the chief's
outputs, and its progress bar shows figures a single replica could (accuracy in [0, 1]) mid-epoch. The SIGTERM
mid-training case is in test_resize.py (the first pair of workers).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from machinery import exits
from machinery import sigterm
from machinery import worker_group
from machinery import worker_sources
from processes import EXIT_SECONDS, ROOT, Worker, assert_one_port_warning, finish, free_ports, subprocess_env, wait_until
from runs import assert_only_documented_outputs

TIMEOUT = 5  # --cluster-timeout of these tests, seconds
# A generous bound on a loaded 2-core machine, where loading TensorFlow alone takes seconds.
START_SECONDS = 60


def tf_config(ports, index):
    cluster_spec = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return {"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": {"type": "worker", "index": index}})}


def args(data_dir, output_dir, *extra):
    return ["--strategy", "multiworker", "--cluster-timeout", str(TIMEOUT), "--epochs", "1", "--steps-per-epoch", "3",
            "--batch-size-per-replica", "16", "--data-dir", data_dir, "--output-dir", output_dir, *extra]


def error_lines(stderr):
    """The lines a person would read as errors: ours, TensorFlow's C++ E-lines, and any traceback."""
    return [line for line in stderr.splitlines()
            if line.startswith(("error:", "E0000", "Traceback")) or re.match(r"E\d{4} ", line)]


# ---------------------------------------------------------------- start-up failures

@pytest.mark.slow
def test_taken_port_is_one_line_and_its_peer_gives_up_naming_it(tmp_path, data_dir):
    """As with two Slurm nodes whose first tasks both take one port: worker 0 cannot listen, worker 1 waits for it."""
    ports = free_ports(2)
    holder = socket.socket()
    holder.bind(("", ports[0]))
    holder.listen()
    try:
        started = time.monotonic()
        workers = [Worker(args(data_dir, str(tmp_path / "out")), tf_config(ports, i), tmp_path, f"w{i}")
                   for i in range(2)]
        statuses = finish(workers, timeout=START_SECONDS + TIMEOUT)
        seconds = time.monotonic() - started
    finally:
        holder.close()
    print(f"taken port: both exited after {seconds:.1f} s")
    assert statuses == [exits.EXIT_PEER_LOST] * 2, [w.stderr[-2000:] for w in workers]
    taken, waiting = (error_lines(w.stderr) for w in workers)
    assert len(taken) == 1 and f"cannot listen on port {ports[0]}" in taken[0], workers[0].stderr[-3000:]
    assert "--slurm-port-base" in taken[0]
    assert len(waiting) == 1, workers[1].stderr[-3000:]
    assert waiting[0].startswith(f"error: the cluster did not form within {TIMEOUT} s: never heard from "
                                 f"worker 0 (127.0.0.1:{ports[0]})")
    assert not os.path.exists(tmp_path / "out" / "results.json")


@pytest.mark.slow
def test_sigterm_while_waiting_for_the_cluster_exits_143_at_once(tmp_path, data_dir):
    ports = free_ports(2)  # worker 1 never comes
    worker = Worker(args(data_dir, str(tmp_path / "out"), "--cluster-timeout", "600"), tf_config(ports, 0),
                    tmp_path, "w0")
    try:
        def listening():  # then it is waiting for worker 1
            assert worker.proc.poll() is None, worker.stderr[-3000:]
            return worker_group.knock(f"127.0.0.1:{ports[0]}")
        wait_until(listening, "listening worker", START_SECONDS)
        sent = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.wait(timeout=EXIT_SECONDS)
        seconds = time.monotonic() - sent
    finally:
        worker.proc.kill()
    print(f"SIGTERM while waiting for the cluster: exit {worker.returncode} after {seconds:.2f} s")
    assert worker.returncode == exits.EXIT_PREEMPTED
    assert error_lines(worker.stderr) == [f"error: {sigterm.OUTSIDE_TRAINING}"]


# ---------------------------------------------------------------- a successful run

class TwoWorkers:
    """Two workers on loopback that train 2 epochs of 6 steps, 2 steps per call (progress bars with figures
    mid-epoch), over a ring, all-reducing in bfloat16, validating each epoch."""

    def __init__(self, directory, data_dir):
        self.ports, self.output_dir = free_ports(2), directory / "out"
        run_args = args(data_dir, str(self.output_dir), "--epochs", "2", "--steps-per-epoch", "6",
                        "--steps-per-execution", "2", "--batch-size-per-replica", "8",
                        "--communication", "ring", "--allreduce-dtype", "bfloat16", "--validation")
        self.workers = [Worker(run_args, tf_config(self.ports, i), directory, f"w{i}") for i in range(2)]
        finish(self.workers, timeout=400)

    def __iter__(self):
        return iter(self.workers)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, data_dir):
    return TwoWorkers(tmp_path_factory.mktemp("two_workers"), data_dir)


@pytest.mark.slow
def test_two_workers_succeed_without_error_lines(two_workers):
    for w, port in zip(two_workers, two_workers.ports):
        assert w.returncode == 0, w.stderr[-3000:]
        assert error_lines(w.stderr) == [], w.stderr[-3000:]
        # Each says, once, that its port is open to anyone (docs/clusters.md, "Open ports").
        assert_one_port_warning(w.stderr, port=port)


@pytest.mark.slow
def test_two_workers_record_their_choices_and_leave_only_the_chiefs_outputs(two_workers):
    results = json.loads((two_workers.output_dir / "results.json").read_text())
    assert results["replicas"] == 2 and results["strategy"] == "multiworker"
    assert results["communication"] == "ring" and results["cross_device_ops"] == "default"
    assert results["step_metrics"] == "all"  # each step's figures all workers', as Keras computes them
    assert results["allreduce_dtype"] == "bfloat16"
    assert results["eval_accuracy_checkpoint"] == results["eval_accuracy_unreplicated"] == results["eval_accuracy_replicated"]
    assert results["eval_accuracy_checkpoint"] > 0.5
    # Validated each epoch: its figures on the chief's progress bar, its own TensorBoard folder.
    assert " - val_loss: " in two_workers.workers[0].stdout
    assert os.path.isdir(two_workers.output_dir / "logs" / "validation")
    # Only the chief's outputs are in --output-dir: no worker's temporary copies, and no backup once finished.
    assert_only_documented_outputs(two_workers.output_dir)
    # The non-chief wrote its copies to a temporary folder of its own (its TMPDIR) and removed it.
    assert os.listdir(two_workers.workers[1].scratch) == []


@pytest.mark.slow
def test_progress_figures_mid_epoch_are_those_of_one_replica(two_workers):
    # Keras's bar redraws its line with '\r'; the figures of every redraw, mid-epoch ones included.
    shown = [line for w in two_workers for line in re.split(r"[\r\n]", w.stdout) if re.match(r"\s*\d+/6 \[", line)]
    mid_epoch = [line for line in shown if re.match(r"\s*[1-5]/6 ", line)]
    assert mid_epoch, shown
    accuracies = [float(a) for line in shown for a in re.findall(r"- accuracy: ([\d.]+)", line)]
    assert accuracies and all(0 <= a <= 1 for a in accuracies), shown


# ---------------------------------------------------------------- SIGTERM's thread, in a small process of its own

# Each runs in a fresh Python (no TensorFlow) with real signals: in pytest's own process, threads that other tests
# started before SIGTERM was blocked could take the signal instead.
WATCHED = """
import os, signal, sys, time
from machinery import exits, sigterm

def until(condition):  # a handshake with SIGTERM's thread, within a few seconds
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "SIGTERM's thread never acted"
        time.sleep(0.01)

with sigterm.watched() as preemption:
    preemption.training = {training}
    os.kill(os.getpid(), signal.SIGTERM)
    {then}
"""


def run_watched(training, then):
    code = WATCHED.format(training=training, then=then)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=EXIT_SECONDS)


def test_sigterm_while_training_is_noted_for_the_next_step_boundary():
    proc = run_watched(True, "until(lambda: preemption.requested)\n    print('noted')")
    assert proc.returncode == 0 and proc.stdout == "noted\n", proc.stderr


def test_a_sigterm_noted_during_training_ends_the_run_as_training_ends():
    """One that came after the last step boundary's check: acted on in the main thread, where training ends."""
    proc = run_watched(True, "until(lambda: preemption.requested)\n"
                             "    try:\n        preemption.end_training()\n"
                             "    except exits.Preempted as err:\n        print('raised:', err)")
    assert proc.returncode == 0 and proc.stdout == f"raised: {sigterm.OUTSIDE_TRAINING}\n", proc.stderr


# The main thread busy in Python, asleep in one C call that does not return, and an exit handler that hangs.
@pytest.mark.parametrize("then", ["while True: sum(range(1000))", "time.sleep(60)",
                                  "atexit.register(time.sleep, 60)\n    time.sleep(60)"],
                         ids=["python", "c-call", "hung-exit-handler"])
def test_sigterm_outside_training_ends_the_process_from_its_own_thread(then):
    """Nothing is raised into the main thread, wherever it is: the process prints its one line, runs its exit
    handlers for up to TIDY_SECONDS, and ends with 143."""
    started = time.monotonic()
    code = "import atexit\natexit.register(print, 'exit handlers ran')\n" + WATCHED.format(training=False, then=then)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=EXIT_SECONDS)
    seconds = time.monotonic() - started
    assert proc.returncode == exits.EXIT_PREEMPTED
    assert proc.stderr == f"error: {sigterm.OUTSIDE_TRAINING}\n"
    assert seconds < 30
    if "atexit" not in then:
        assert proc.stdout == "exit handlers ran\n"


def test_sigterm_while_the_results_are_written_is_ignored():
    """Once the run writes results.json it ends in moments; a 143 then would have a restart find a finished run.
    A SIGTERM that came first wins: the main thread, reaching the results, waits there for the process's end."""
    def watched_run(before, after):
        code = ("import atexit, time\natexit.register(time.sleep, 1)\n"  # the exit handlers take a second
                + WATCHED.format(training=False, then=after).replace("    os.kill", f"    {before}\n    os.kill")
                + "print('finished')\n")
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                              text=True, timeout=EXIT_SECONDS)

    # SIGTERM's thread took the signal (it is no longer pending) while the results were written.
    finished = watched_run("preemption.finishing()", "until(lambda: signal.SIGTERM not in signal.sigpending())")
    assert finished.returncode == 0 and finished.stdout == "finished\n" and finished.stderr == "", finished.stderr
    # SIGTERM's thread is ending the process when the results are reached.
    ended = watched_run("pass", "until(lambda: preemption._ending)\n    preemption.finishing()")
    assert ended.returncode == exits.EXIT_PREEMPTED and ended.stdout == "", ended.stdout
    assert ended.stderr == f"error: {sigterm.OUTSIDE_TRAINING}\n"


def test_slurm_port_base_comes_from_the_job_id():
    assert worker_sources.slurm_port_base(8888, {"SLURM_JOB_ID": "4242"}) == 8888  # --slurm-port-base wins
    bases = {job: worker_sources.slurm_port_base(None, {"SLURM_JOB_ID": str(job)}) for job in range(100000, 100000 + 1400)}
    # Every job of a run of 1,400 consecutive ids gets a block of its own, below the ephemeral ports.
    assert len(set(bases.values())) == 1400
    assert all(b % worker_sources.SLURM_PORTS_PER_JOB == 0 for b in bases.values())
    assert min(bases.values()) >= worker_sources.SLURM_PORT_FIRST
    assert max(bases.values()) + worker_sources.SLURM_PORTS_PER_JOB <= 32768
    with pytest.raises(exits.UsageError, match="SLURM_JOB_ID"):
        worker_sources.slurm_port_base(None, {"SLURM_JOB_ID": "12_3"})
