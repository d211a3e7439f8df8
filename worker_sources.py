"""Where the workers of `--strategy multiworker` come from: TF_CONFIG, a Kubernetes Indexed Job, or Slurm's srun
(beside the tutorial's step 1).

TF_CONFIG wins where it is set (Kubeflow's TFJob writes it). Without it, an Indexed Job's pod knows its index
(JOB_COMPLETION_INDEX) and, from variables its manifest sets, how many workers there are and their stable host
names, `<job>-<index>.<service>`; under Slurm, the variables srun sets for each task describe the cluster. `check`
reads them before TensorFlow starts, so that a mistake is one `error:` line and exit 2; `cluster_resolver` then
gives TensorFlow the same cluster. How the workers come together and leave is worker_group.py.
"""

import json
import os
import re
import shutil
import socket

import config
from config import UsageError

TF_CONFIG, INDEXED_JOB, SLURM = "TF_CONFIG", "Indexed Job", "Slurm"
# A host name as Kubernetes gives pods and Services (RFC 1123 labels), joined by dots.
LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
HOST_NAME = re.compile(rf"{LABEL}(\.{LABEL})*")


def source(environ):
    """Which of the three describes the cluster: TF_CONFIG wins, then an Indexed Job's variables, then srun's."""
    if environ.get("TF_CONFIG"):
        return TF_CONFIG
    if any(name in environ for name in config.INDEXED_JOB_VARS):
        return INDEXED_JOB
    if in_slurm(environ):
        return SLURM
    return TF_CONFIG  # none of them: TF_CONFIG's check says what is missing


def check(cfg, environ):
    """Raises UsageError when a multi-worker run's variables do not describe a cluster (before TensorFlow starts)."""
    if cfg.strategy != "multiworker":
        return
    read = {TF_CONFIG: lambda: parse_tf_config(environ.get("TF_CONFIG")),
            INDEXED_JOB: lambda: indexed_job(environ, socket.gethostname()), SLURM: lambda: parse_slurm(environ)}
    read[source(environ)]()


def parse_tf_config(raw):
    """Returns (task_type, task_index, cluster) from TF_CONFIG's text, or raises UsageError."""
    fix = 'set TF_CONFIG like {"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}'
    if not raw:
        raise UsageError("--strategy multiworker needs the TF_CONFIG environment variable, a Kubernetes Indexed "
                         "Job's variables (deploy/indexed-job.yaml), or to be started by Slurm's srun (one task per "
                         f"worker); {fix}")
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
        raise UsageError(f'TF_CONFIG\'s task index {index!r} is not a position in the {task["type"]!r} list; {fix}')
    return task["type"], index, cluster


def in_slurm(environ):
    """True inside a Slurm job: srun's tasks, but also a batch script that forgot srun."""
    return "SLURM_JOB_ID" in environ or "SLURM_PROCID" in environ


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


def parse_slurm(environ):
    """Returns (rank, tasks) from srun's variables, or raises UsageError.

    TensorFlow's SlurmClusterResolver reads the same variables; checking them here reports a mistake before
    TensorFlow starts. It checks the host and tasks-per-node lists itself, when the strategy is made.
    """
    fix = "start one task per worker with srun inside the job (docs/clusters.md, \"Slurm\"), or set TF_CONFIG"
    missing = [name for name in config.SLURM_STEP_VARS if not environ.get(name)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: this Slurm job's workers were not started by srun; {fix}")
    rank, tasks = _whole_numbers(environ, ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"), fix)
    if tasks < 1 or not 0 <= rank < tasks:
        raise UsageError(f"SLURM_PROCID={rank} is not a task of the step's SLURM_STEP_NUM_TASKS={tasks}; {fix}")
    return rank, tasks


def indexed_job(environ, own_host):
    """Returns (index, ["host:port", ...]) from an Indexed Job pod's variables, or raises UsageError; `own_host`
    is this pod's host name.

    The Job controller sets JOB_COMPLETION_INDEX and names each pod's host `<job>-<index>`; with the pod's
    `subdomain` set to a headless Service, `<job>-<index>.<service>` resolves to that pod (docs/clusters.md,
    "Kubernetes"). The manifest gives the count, that name with {index} for the index, and the port.
    """
    fix = "set the pod's variables as deploy/indexed-job.yaml does (docs/clusters.md, \"Kubernetes\"), or set TF_CONFIG"
    missing = [name for name in config.INDEXED_JOB_VARS if not environ.get(name)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: a Kubernetes Indexed Job's pod needs all of "
                         f"{', '.join(config.INDEXED_JOB_VARS)} (the Job controller sets the first); {fix}")
    index, workers, port = _whole_numbers(environ, ("JOB_COMPLETION_INDEX", "MNIST_WORKERS", "MNIST_WORKER_PORT"), fix)
    if workers < 1 or not 0 <= index < workers:
        raise UsageError(f"JOB_COMPLETION_INDEX={index} is not a worker of MNIST_WORKERS={workers}; give "
                         "MNIST_WORKERS the Job's completions and parallelism")
    config.check_port(port, f"MNIST_WORKER_PORT={port}", fix)
    pattern = environ["MNIST_WORKER_HOST"]
    hosts = [pattern.replace("{index}", str(i)) for i in range(workers)]
    if pattern.count("{index}") != 1 or not all(HOST_NAME.fullmatch(host) for host in hosts):
        raise UsageError(f"MNIST_WORKER_HOST={pattern!r} is not a host name with {{index}} standing for the "
                         "worker's index, like <job>-{index}.<service>; " + fix)
    # The Job controller names this pod's host `<job>-<index>` (a pod on the node's network, hostNetwork, has the
    # node's name instead): a pattern naming another job would leave every worker waiting for pods that never come.
    if own_host.endswith(f"-{index}") and hosts[index].split(".")[0] != own_host:
        raise UsageError(f"MNIST_WORKER_HOST={pattern!r} names this pod {hosts[index]}, but its host name is "
                         f"{own_host}; start the pattern with the Job's name, <job>-{{index}}, and follow it with the "
                         "headless Service that is the pod's subdomain")
    return index, [f"{host}:{port}" for host in hosts]


def cluster_resolver(cfg, tf):
    """TF_CONFIG when it is set (Kubeflow's TFJob writes it, chief included), else an Indexed Job's variables,
    else the Slurm job step's."""
    where = source(os.environ)
    if where == TF_CONFIG:
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if where == INDEXED_JOB:
        index, workers = indexed_job(os.environ, socket.gethostname())
        # Worker 0 is the chief, as in a TF_CONFIG without a "chief" list; the GPUs are this pod's own.
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=index, rpc_layer="grpc",
            num_accelerators={"GPU": len(tf.config.list_physical_devices("GPU"))})
    try:
        port_base = slurm_port_base(cfg.slurm_port_base, os.environ)
        if slurm_node_has_gpus():
            # TensorFlow's resolver counts the node's GPUs and gives each task its share in CUDA_VISIBLE_DEVICES.
            slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base)
            slurm.cluster_spec()
            show_only_gpus(os.environ["CUDA_VISIBLE_DEVICES"], tf)
            return slurm
        # Told "no GPUs", TensorFlow's resolver lists no tasks at all (it hands out one port per GPU share), so
        # give it one share per task, keep its cluster and task, and tell the strategy there are no GPUs.
        tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
        slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port_base, gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False)
        cluster = slurm.cluster_spec()
        task_type, task_id = slurm.get_task_info()
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, task_type=task_type, task_id=task_id, rpc_layer=slurm.rpc_layer, num_accelerators={"GPU": 0})
    except (ValueError, RuntimeError) as err:
        # TensorFlow's resolver raises these for host or tasks-per-node lists it cannot read, or that disagree.
        raise UsageError(f"the Slurm variables do not describe this job step ({err}); start one task per worker "
                         "with srun inside the job (docs/clusters.md, \"Slurm\"), or set TF_CONFIG") from None


def slurm_port_base(chosen, environ):
    """--slurm-port-base if given, else a block of ports of the job's own (config.SLURM_PORT_FIRST), so that two
    jobs sharing a node do not both take TensorFlow's 8888."""
    if chosen is not None:
        return chosen
    job = environ.get("SLURM_JOB_ID", "0")
    if not job.isdigit():
        raise UsageError(f"SLURM_JOB_ID={job!r} is not a job number; give the ports with --slurm-port-base")
    return config.SLURM_PORT_FIRST + config.SLURM_PORTS_PER_JOB * (int(job) % config.SLURM_PORT_SLOTS)


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
