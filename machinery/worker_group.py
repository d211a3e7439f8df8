"""How the workers of `--strategy multiworker` come together, and how they leave (beside the tutorial's step 1).

Each worker warns that its port is open, waits (interruptibly, and no longer than --cluster-timeout) until every
other worker has knocked, and only then lets TensorFlow form the cluster. A cluster that cannot form, and a run
that loses a worker, are told apart from any other failure so that they exit with a retryable status (README,
"Exit codes"); a multi-worker process leaves without TensorFlow's teardown. Where the workers come from is
worker_sources.py.
"""

import contextlib
import gc
import hashlib
import json
import socket
import sys
import time

from machinery import worker_sources
from machinery import sigterm
from machinery import tf_private
from machinery.exits import EXIT_OK, EXIT_PREEMPTED, ClusterNotFormed

# The jobs of TF_CONFIG whose tasks train together (TensorFlow's coordination service registers these two).
TRAINING_JOBS = ("chief", "worker")
# How often a waiting worker knocks on the other workers' ports, and how long one knock may take.
KNOCK_SECONDS = 0.25
KNOCK_TIMEOUT_SECONDS = 0.5
# Once every worker has knocked, TensorFlow's own registration takes a second or two; this bounds it, should a worker
# die in between (TensorFlow's default is an hour, with the main thread deaf to signals all along).
REGISTER_SECONDS = 60
# At the end of a successful run every worker waits for the others (at most this long) before leaving, so that
# no worker outlives the one hosting the coordination service and logs its lost heartbeats as errors.
EXIT_BARRIER = "mnist-mirrored-exit"
EXIT_BARRIER_SECONDS = 60
# The cluster this process formed (form()), where a lost worker is looked for.
_formed = None


def check_port_and_warn_open(resolver):
    """Raises UsageError when this worker's port does not exist; else warns that it will be open: TensorFlow's gRPC
    server binds every interface, whatever host the cluster names, and checks no identity."""
    task_type, task_id, port = resolver.task_type, resolver.task_id, own_port(resolver)
    worker_sources.check_port(port, f"{task_type} {task_id}'s port {port}",
                      "choose a lower --slurm-port-base, or fix the ports in TF_CONFIG")
    print(f"warning: {task_type} {task_id} listens on port {port} on every network interface, unauthenticated "
          "(TensorFlow's gRPC server); run multi-worker training only on a trusted network or behind a firewall "
          "(docs/clusters.md, \"Open ports\")", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the cluster forms

def host_port(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def own_port(resolver):
    return host_port(resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id))[1]


def others(resolver):
    """{"worker 1": "host:port", ...}: every task that trains with this one."""
    spec = resolver.cluster_spec()
    return {f"{job} {index}": address for job in TRAINING_JOBS if job in spec.jobs
            for index, address in enumerate(spec.job_tasks(job)) if (job, index) != (resolver.task_type, resolver.task_id)}


def knock(address, greeting=b""):
    """Tells the worker listening at `address` who is here (without a greeting, only asks whether a process listens
    there and accepts a connection within a knock's time); False if nothing listens there (yet)."""
    try:
        with socket.create_connection(host_port(address), timeout=KNOCK_TIMEOUT_SECONDS) as door:
            door.sendall(greeting)
        return True
    except OSError:  # refused, unreachable, or a name the DNS does not know yet (a pod not up)
        return False


def greetings(listener):
    """The greetings of the knocks waiting at `listener`."""
    heard = set()
    while True:
        try:
            door, _ = listener.accept()
        except BlockingIOError:
            return heard
        with door:
            door.settimeout(KNOCK_TIMEOUT_SECONDS)
            with contextlib.suppress(OSError):
                heard.add(door.recv(1024))


def never_came(missing, seconds):
    names = ", ".join(f"{name} ({address})" for name, address in missing.items())
    return (f"the cluster did not form within {seconds} s: never heard from {names}; check that every worker was "
            "started and reaches this one, then restart them all with the same command (or raise --cluster-timeout)")


def not_registered(missing):
    names = ", ".join(f"{name} ({address})" for name, address in missing.items()) or "the other workers"
    return (f"the cluster did not form: TensorFlow's registration gave up after {REGISTER_SECONDS} s waiting for "
            f"{names}, which had knocked; restart every worker with the same command")


def port_taken(resolver, err):
    return (f"{resolver.task_type} {resolver.task_id} cannot listen on port {own_port(resolver)}: another process on "
            f"this host holds it ({err}); restart when it is free, or give this run other ports (--slurm-port-base, "
            "MNIST_WORKER_PORT, or the ports in TF_CONFIG)")


def wait_for_others(resolver, timeout):
    """Listens on this worker's port and returns once every other worker has knocked on it; raises
    ClusterNotFormed when this port is taken, or after `timeout` seconds naming those that never knocked.

    TensorFlow's own wait (the strategy's constructor) blocks in C++ with Python's GIL held, so neither SIGTERM
    nor Ctrl-C reaches the program there; here the wait is Python's. Each worker knocks on every other's port,
    saying who it is and which cluster it belongs to, until all have knocked on its own; a port that merely
    accepts connections (another job's server, say) counts for nothing. A worker hands its port to TensorFlow only
    once all have knocked, and it knocked on each of them before that, so none is left waiting for it.
    """
    names = others(resolver)
    cluster_id = hashlib.sha256(json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True).encode()).hexdigest()
    greeting = f"{cluster_id} {resolver.task_type} {resolver.task_id}".encode()
    expected = {f"{cluster_id} {name}".encode(): name for name in names}
    with socket.socket() as listener:
        # As TensorFlow's server binds: every interface, TIME_WAIT leftovers of an earlier run allowed.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", own_port(resolver)))
        except OSError as err:
            raise ClusterNotFormed(port_taken(resolver, err.strerror)) from None
        listener.listen()
        listener.setblocking(False)
        missing = dict(names)
        deadline = time.monotonic() + timeout
        while True:
            for address in names.values():
                knock(address, greeting)
            for heard in greetings(listener):
                missing.pop(expected.get(heard), None)
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise ClusterNotFormed(never_came(missing, timeout))
            time.sleep(KNOCK_SECONDS)


def form(resolver, make_strategy, tf, *, timeout, verbose):
    """`make_strategy()` (a MultiWorkerMirroredStrategy for `resolver`), once every worker is there."""
    from machinery import terminal

    wait_for_others(resolver, timeout)
    global _formed
    tf_private.configure_coordination(resolver.cluster_spec(), TRAINING_JOBS, REGISTER_SECONDS)
    _formed = resolver
    # TensorFlow logs its failures here as several C++ lines, and again as it frees what it had started (hence the
    # collection inside); the error line says it in one.
    with terminal.startup_output_held(verbose, explained=ClusterNotFormed):
        try:
            return make_strategy()
        except tf.errors.DeadlineExceededError as err:
            missing = {f"{job} {task}": resolver.cluster_spec().task_address(job, task)
                       for job, task in tf_private.timed_out_tasks(err.message)}
            failure = not_registered(missing)
        except tf.errors.UnknownError as err:
            if not tf_private.grpc_server_not_started(err.message):
                raise
            failure = port_taken(resolver, "taken after this worker's check")
        gc.collect()
        raise ClusterNotFormed(failure)


def started():
    """Whether this process started TensorFlow's multi-worker runtime (its coordination service is configured)."""
    return "tensorflow" in sys.modules and tf_private.coordination_configured()


def leave(status):
    """Ends this process now with `status`, after the last barrier of a run that succeeded or was pre-empted: every
    worker has saved by then, so none is killed mid-save when another's exit ends the Slurm step (srun
    --kill-on-bad-exit, deploy/slurm.sbatch).

    TensorFlow's teardown of a multi-worker runtime takes seconds and logs errors when the coordination service's
    host is gone first (docs/clusters.md, "Leaving together"); after a collective abort it is unusable anyway.
    Everything worth keeping is on disk by now (checkpoints, backup, TensorBoard's events, which its writers flush
    at each epoch's end).
    """
    if status in (EXIT_OK, EXIT_PREEMPTED):
        with contextlib.suppress(Exception):  # a worker gone by now: this one has finished all the same
            tf_private.wait_at_barrier(EXIT_BARRIER, EXIT_BARRIER_SECONDS)
    sigterm.end_process(status)


# ---------------------------------------------------------------- a lost peer

# Measured with two workers on loopback: a peer's process killed, or stopped so that its heartbeats stop,
# aborts every collective op here with UnavailableError; the peer hosting the coordination service stopped gives
# DeadlineExceededError on its heartbeat (how soon: docs/clusters.md, "A lost worker"). So no collective timeout
# is needed for a survivor to leave. Which task was lost the message does not reliably
# say: it may name the peer, or only this task (the one whose op was aborted).


def lost_peer(cfg, err):
    """What was lost, when `err` is a multi-worker run losing one of its workers; None for any other error."""
    tf = sys.modules.get("tensorflow")
    if cfg is None or cfg.strategy != "multiworker" or tf is None:
        return None
    if not isinstance(err, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
        return None
    return lost_workers(_formed, err.message)


def lost_workers(resolver, message):
    """Which workers of the cluster `resolver` describes this one lost, as words: those whose port no longer
    answers (a process gone, a host cut off); else, since a stopped process keeps its port open, the one whose
    heartbeats went unanswered (the coordination service's host) or those TensorFlow's `message` names. Never
    this worker itself: the message may name only it. Says so when it cannot tell."""
    reason = tf_private.abort_reason(message)
    if resolver is None:
        return f"lost a worker of this multi-worker run, but cannot tell which ({reason})"
    peers = others(resolver)
    gone = [name for name, address in peers.items() if not knock(address)]
    if tf_private.leader_heartbeat_failed(message):
        named = ["{} {}".format(*tf_private.coordination_leader(resolver.cluster_spec()))]
    else:
        named = [f"{job} {index}" for job, index in tf_private.named_tasks(message)]
    lost = gone or [name for name in named if name in peers]
    if not lost:
        return (f"lost a worker of this multi-worker run, but cannot tell which: TensorFlow's error names none "
                f"other than this one, and every other worker's port still answers ({reason})")
    return f"lost {' and '.join(lost)} of this multi-worker run ({reason})"
