"""Where the workers of `--strategy multiworker` come from: TF_CONFIG, a Kubeflow TrainJob, a Kubernetes Indexed
Job, or Slurm's srun (beside the tutorial's step 1).

Each source is one small class, as Lightning's cluster environments are: `detect` says whether the environment
is that source's; made from the environment, it checks it before TensorFlow starts, so that a mistake is one
`error:` line and exit 2, and knows this worker's `rank` among `count` (rank 0 is the chief); `resolver` then
gives TensorFlow the same cluster. The first of SOURCES that detects its variables wins: TF_CONFIG (Kubeflow's
TFJob writes it), then a Kubeflow TrainJob's pod or an Indexed Job's, which knows its index (JOB_COMPLETION_INDEX)
and, from variables its manifest sets, how many workers there are and their stable host names; then the variables
srun sets for each task. How the workers come together and leave is worker_group.py.
"""

import json
import os
import re
import shutil
import socket

from machinery.exits import UsageError

# What srun sets for each task of a job step, and TensorFlow's SlurmClusterResolver reads.
SLURM_STEP_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
# What each pod of a Kubernetes Indexed Job is told: its index (the Job controller sets it), and from the manifest
# (deploy/indexed-job.yaml) the worker count, every worker's host name with {index} standing for its index, and
# the port every worker listens on.
INDEXED_JOB_VARS = ("JOB_COMPLETION_INDEX", "MNIST_WORKERS", "MNIST_WORKER_HOST", "MNIST_WORKER_PORT")
# What each pod of a Kubeflow TrainJob is told (deploy/trainjob.yaml): its index, the TrainJob's name (its runtime
# reads the JobSet's label below), the worker count and the port. Trainer names the JobSet after the TrainJob and
# runs its pods as the replicated job below.
TRAINJOB_VARS = ("JOB_COMPLETION_INDEX", "MNIST_TRAINJOB", "MNIST_WORKERS", "MNIST_WORKER_PORT")
TRAINJOB_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
TRAINJOB_REPLICATED_JOB = "node"
MAX_PORT = 65535
# Under srun without --slurm-port-base, a job's node's first worker listens on SLURM_PORT_FIRST plus
# SLURM_PORTS_PER_JOB times (SLURM_JOB_ID modulo SLURM_PORT_SLOTS): jobs sharing a node take different blocks of
# 16 ports (up to 16 workers a node), all below Linux's ephemeral ports (32768 up), which outgoing connections use.
SLURM_PORT_FIRST = 10000
SLURM_PORTS_PER_JOB = 16
SLURM_PORT_SLOTS = 1400

# A host name as Kubernetes gives pods and Services (RFC 1123 labels), joined by dots.
LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
HOST_NAME = re.compile(rf"{LABEL}(\.{LABEL})*")


def _whole_numbers(environ, names, fix):
    """The variables `names` of `environ` as whole numbers, in that order, or UsageError naming the first that
    is not."""
    numbers = []
    for name in names:
        try:
            numbers.append(int(environ[name]))
        except ValueError:
            raise UsageError(f"{name}={environ[name]!r} is not a whole number; {fix}") from None
    return numbers


def check_port(port, what, fix):
    """Raises UsageError unless `port` exists (1-MAX_PORT); `what` names it where the user set it."""
    if not 1 <= port <= MAX_PORT:
        raise UsageError(f"{what} is not a port number, 1-{MAX_PORT}; {fix}")


class TFConfig:
    """TF_CONFIG's cluster and task, as written by hand or by Kubeflow's TFJob (chief included)."""

    FIX = ('set TF_CONFIG like {"cluster": {"worker": ["host1:port", "host2:port"]}, '
           '"task": {"type": "worker", "index": 0}}')

    @staticmethod
    def detect(environ):
        return bool(environ.get("TF_CONFIG"))

    def __init__(self, environ, host=None):
        raw, fix = environ.get("TF_CONFIG"), self.FIX
        if not raw:
            raise UsageError("--strategy multiworker needs the TF_CONFIG environment variable, a Kubernetes Indexed "
                             "Job's or TrainJob's variables (deploy/), or to be started by Slurm's srun (one task "
                             f"per worker); {fix}")
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as err:
            raise UsageError(f"TF_CONFIG is not valid JSON ({err.msg} at character {err.pos}); {fix}") from None
        cluster = spec.get("cluster") if isinstance(spec, dict) else None
        task = spec.get("task") if isinstance(spec, dict) else None
        if not isinstance(cluster, dict) or not cluster.get("worker") and not cluster.get("chief"):
            raise UsageError(f'TF_CONFIG has no "cluster" with a "worker" list; {fix}')
        if any(not isinstance(v, list) or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in v)
               for v in cluster.values()):
            raise UsageError(f'TF_CONFIG\'s cluster lists must hold "host:port" strings; {fix}')
        if not isinstance(task, dict) or task.get("type") not in cluster:
            raise UsageError(f'TF_CONFIG\'s "task" must have a "type" that names a list in "cluster"; {fix}')
        index = task.get("index")
        if not isinstance(index, int) or not 0 <= index < len(cluster[task["type"]]):
            raise UsageError(f'TF_CONFIG\'s task index {index!r} is not a position in the {task["type"]!r} list; '
                             f'{fix}')
        # TensorFlow's order: the chief, where there is one, then the workers (worker 0 is the chief without one).
        training = [kind for kind in ("chief", "worker") if kind in cluster]
        self.count = sum(len(cluster[kind]) for kind in training)
        before = training[:training.index(task["type"])] if task["type"] in training else training
        self.rank = sum(len(cluster[kind]) for kind in before) + index
        self.task_type, self.cluster = task["type"], cluster

    def resolver(self, cfg, tf):
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()


class IndexedJob:
    """A Kubernetes Indexed Job's pod, `host` being its host name.

    The Job controller sets JOB_COMPLETION_INDEX and names each pod's host `<job>-<index>`; with the pod's
    `subdomain` set to a headless Service, `<job>-<index>.<service>` resolves to that pod (docs/clusters.md,
    "Kubernetes"). The manifest gives the count, that name with {index} for the index, and the port.
    """

    POD = "a Kubernetes Indexed Job's pod"
    VARS = INDEXED_JOB_VARS
    FIX = ("set the pod's variables as deploy/indexed-job.yaml does (docs/clusters.md, \"Kubernetes\"), or set "
           "TF_CONFIG")
    COUNT = "the Job's completions and parallelism"

    @classmethod
    def detect(cls, environ):
        return any(name in environ for name in cls.VARS)

    def __init__(self, environ, host):
        missing = [name for name in self.VARS if not environ.get(name)]
        if missing:
            raise UsageError(f"{', '.join(missing)} not set: {self.POD} needs all of "
                             f"{', '.join(self.VARS)} (the Job controller sets the first); {self.FIX}")
        index, workers, port = _whole_numbers(environ, ("JOB_COMPLETION_INDEX", "MNIST_WORKERS", "MNIST_WORKER_PORT"),
                                              self.FIX)
        if workers < 1 or not 0 <= index < workers:
            raise UsageError(f"JOB_COMPLETION_INDEX={index} is not a worker of MNIST_WORKERS={workers}; give "
                             f"MNIST_WORKERS {self.COUNT}")
        check_port(port, f"MNIST_WORKER_PORT={port}", self.FIX)
        hosts = self.hosts(environ, workers)
        # The Job controller names this pod's host after its Job and index (a pod on the node's network,
        # hostNetwork, has the node's name instead): names of another job would leave every worker waiting for
        # pods that never come.
        if host.endswith(f"-{index}") and hosts[index].split(".")[0] != host:
            self.refuse_host(environ, hosts[index], host)
        self.rank, self.count = index, workers
        self.addresses = [f"{h}:{port}" for h in hosts]

    @staticmethod
    def hosts(environ, workers):
        """Every worker's host name, from MNIST_WORKER_HOST."""
        pattern = environ["MNIST_WORKER_HOST"]
        hosts = [pattern.replace("{index}", str(i)) for i in range(workers)]
        if pattern.count("{index}") != 1 or not all(HOST_NAME.fullmatch(h) for h in hosts):
            raise UsageError(f"MNIST_WORKER_HOST={pattern!r} is not a host name with {{index}} standing for the "
                             "worker's index, like <job>-{index}.<service>; " + IndexedJob.FIX)
        return hosts

    @staticmethod
    def refuse_host(environ, named, host):
        raise UsageError(f"MNIST_WORKER_HOST={environ['MNIST_WORKER_HOST']!r} names this pod {named}, but its host "
                         f"name is {host}; start the pattern with the Job's name, <job>-{{index}}, and follow it "
                         "with the headless Service that is the pod's subdomain")

    def resolver(self, cfg, tf):
        # Worker 0 is the chief, as in a TF_CONFIG without a "chief" list; the GPUs are this pod's own.
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": self.addresses}), task_type="worker", task_id=self.rank,
            rpc_layer="grpc", num_accelerators={"GPU": len(tf.config.list_physical_devices("GPU"))})


class TrainJob(IndexedJob):
    """A pod of a Kubeflow Trainer TrainJob on a runtime that names no framework (Trainer's plainml plugin).

    Trainer runs the TrainJob as a JobSet of its name, whose replicated job `node` has numNodes pods: pod i's host
    is `<trainjob>-node-0-<i>`, and the JobSet's headless Service, of the TrainJob's name too, makes
    `<trainjob>-node-0-<i>.<trainjob>` resolve to it. The runtime gives the TrainJob's name (MNIST_TRAINJOB, from
    the JobSet's label on the pod) and the port; the TrainJob gives the count (deploy/trainjob.yaml).
    """

    POD = "a Kubeflow TrainJob's pod"
    VARS = TRAINJOB_VARS
    FIX = "set the variables as deploy/trainjob.yaml does (docs/clusters.md, \"Kubeflow Trainer\"), or set TF_CONFIG"
    COUNT = "the TrainJob's numNodes"

    @staticmethod
    def detect(environ):
        return "MNIST_TRAINJOB" in environ

    @staticmethod
    def hosts(environ, workers):
        job = environ["MNIST_TRAINJOB"]
        if not HOST_NAME.fullmatch(job) or "." in job:
            raise UsageError(f"MNIST_TRAINJOB={job!r} is not a TrainJob's name (a DNS label); give it the JobSet's "
                             f"label {TRAINJOB_NAME_LABEL}, as deploy/trainjob.yaml does")
        return [f"{job}-{TRAINJOB_REPLICATED_JOB}-0-{i}.{job}" for i in range(workers)]

    @staticmethod
    def refuse_host(environ, named, host):
        raise UsageError(f"MNIST_TRAINJOB={environ['MNIST_TRAINJOB']!r} names this pod {named}, but its host name is "
                         f"{host}; give MNIST_TRAINJOB the JobSet's label {TRAINJOB_NAME_LABEL}, and name the "
                         f"runtime's replicated job {TRAINJOB_REPLICATED_JOB!r}, as deploy/trainjob.yaml does")


class Slurm:
    """The tasks srun starts, one per worker.

    TensorFlow's SlurmClusterResolver reads the same variables; checking them here reports a mistake before
    TensorFlow starts. It checks the host and tasks-per-node lists itself, when the strategy is made.
    """

    FIX = "start one task per worker with srun inside the job (docs/clusters.md, \"Slurm\"), or set TF_CONFIG"

    @staticmethod
    def detect(environ):
        """True inside a Slurm job: srun's tasks, but also a batch script that forgot srun."""
        return "SLURM_JOB_ID" in environ or "SLURM_PROCID" in environ

    def __init__(self, environ, host=None):
        missing = [name for name in SLURM_STEP_VARS if not environ.get(name)]
        if missing:
            raise UsageError(f"{', '.join(missing)} not set: this Slurm job's workers were not started by srun; "
                             f"{self.FIX}")
        rank, tasks = _whole_numbers(environ, ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"), self.FIX)
        if tasks < 1 or not 0 <= rank < tasks:
            raise UsageError(f"SLURM_PROCID={rank} is not a task of the step's SLURM_STEP_NUM_TASKS={tasks}; "
                             f"{self.FIX}")
        self.rank, self.count, self.environ = rank, tasks, environ

    def resolver(self, cfg, tf):
        try:
            port_base = slurm_port_base(cfg.slurm_port_base, self.environ)
            if slurm_node_has_gpus():
                # TensorFlow's resolver counts the node's GPUs and gives each task its share in CUDA_VISIBLE_DEVICES.
                slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base)
                slurm.cluster_spec()
                show_only_gpus(os.environ["CUDA_VISIBLE_DEVICES"], tf)
                return slurm
            # Told "no GPUs", TensorFlow's resolver lists no tasks at all (it hands out one port per GPU share), so
            # give it one share per task, keep its cluster and task, and tell the strategy there are no GPUs.
            slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
                port_base=port_base, gpus_per_node=self.count, gpus_per_task=1, auto_set_gpu=False)
            cluster = slurm.cluster_spec()
            task_type, task_id = slurm.get_task_info()
            return tf.distribute.cluster_resolver.SimpleClusterResolver(
                cluster, task_type=task_type, task_id=task_id, rpc_layer=slurm.rpc_layer,
                num_accelerators={"GPU": 0})
        except (ValueError, RuntimeError) as err:
            # TensorFlow's resolver raises these for host or tasks-per-node lists it cannot read, or that disagree.
            raise UsageError(f"the Slurm variables do not describe this job step ({err}); {self.FIX}") from None


# The first whose variables are set describes the cluster; with none, TF_CONFIG's check says what is missing.
SOURCES = (TFConfig, TrainJob, IndexedJob, Slurm)


def find(environ, host):
    """The source of workers `environ` describes, checked (UsageError); `host` is this machine's host name."""
    kind = next((kind for kind in SOURCES if kind.detect(environ)), TFConfig)
    return kind(environ, host)


def check(cfg, environ):
    """Raises UsageError when a multi-worker run's variables do not describe a cluster (before TensorFlow starts);
    returns the source, or None for a run of one process."""
    if cfg.strategy != "multiworker":
        return None
    return find(environ, socket.gethostname())


def cluster_resolver(cfg, tf):
    """TensorFlow's cluster resolver for the source this process's environment describes."""
    return find(os.environ, socket.gethostname()).resolver(cfg, tf)


def slurm_port_base(chosen, environ):
    """--slurm-port-base if given, else a block of ports of the job's own (SLURM_PORT_FIRST), so that two
    jobs sharing a node do not both take TensorFlow's 8888."""
    if chosen is not None:
        return chosen
    job = environ.get("SLURM_JOB_ID", "0")
    if not job.isdigit():
        raise UsageError(f"SLURM_JOB_ID={job!r} is not a job number; give the ports with --slurm-port-base")
    return SLURM_PORT_FIRST + SLURM_PORTS_PER_JOB * (int(job) % SLURM_PORT_SLOTS)


def show_only_gpus(share, tf):
    """CUDA reads CUDA_VISIBLE_DEVICES once, and start_tensorflow has already probed the GPUs, so the resolver's
    share (indices among the GPUs this process sees) becomes TensorFlow's visible devices instead."""
    gpus = tf.config.list_physical_devices("GPU")
    indices = [int(i) for i in share.split(",")]
    if max(indices) >= len(gpus):
        raise UsageError(f"Slurm's task was given GPUs {share}, but TensorFlow sees {len(gpus)} GPUs here; "
                         "give each task at least one GPU of its node, or run on nodes without GPUs")
    tf.config.set_visible_devices([gpus[i] for i in indices], "GPU")


def slurm_node_has_gpus():
    """Whether TensorFlow's own GPU count can run here: it reads CUDA_VISIBLE_DEVICES (Slurm sets it for GPU
    jobs), else asks nvidia-smi, which a machine without GPUs lacks (FileNotFoundError)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")  # both mean "no GPUs" to CUDA
    return shutil.which("nvidia-smi") is not None
