"""Where the workers of `--strategy multiworker` come from: TF_CONFIG, or Slurm's srun (beside the tutorial's
step 1).

TF_CONFIG wins where it is set (Kubeflow's TFJob writes it); without it, the variables Slurm's srun sets for each
task describe the cluster. `check` reads them before TensorFlow starts, so that a mistake is one `error:` line and
exit 2; `cluster_resolver` then gives TensorFlow the same cluster. How the workers come together and leave is
worker_group.py.
"""

import json
import os
import shutil

import config
from config import UsageError


def check(cfg, environ):
    """Raises UsageError when a multi-worker run's variables do not describe a cluster (before TensorFlow starts)."""
    if cfg.strategy != "multiworker":
        return
    if environ.get("TF_CONFIG") or not in_slurm(environ):
        parse_tf_config(environ.get("TF_CONFIG"))
    else:
        parse_slurm(environ)


def parse_tf_config(raw):
    """Returns (task_type, task_index, cluster) from TF_CONFIG's text, or raises UsageError."""
    fix = 'set TF_CONFIG like {"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}'
    if not raw:
        raise UsageError("--strategy multiworker needs the TF_CONFIG environment variable, or to be started by "
                         f"Slurm's srun (one task per worker); {fix}")
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


def parse_slurm(environ):
    """Returns (rank, tasks) from srun's variables, or raises UsageError.

    TensorFlow's SlurmClusterResolver reads the same variables; checking them here reports a mistake before
    TensorFlow starts. It checks the host and tasks-per-node lists itself, when the strategy is made.
    """
    fix = "start one task per worker with srun inside the job (docs/clusters.md, \"Slurm\"), or set TF_CONFIG"
    missing = [name for name in config.SLURM_STEP_VARS if not environ.get(name)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: this Slurm job's workers were not started by srun; {fix}")
    counts = {}
    for name in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        try:
            counts[name] = int(environ[name])
        except ValueError:
            raise UsageError(f"{name}={environ[name]!r} is not a whole number; {fix}") from None
    rank, tasks = counts["SLURM_PROCID"], counts["SLURM_STEP_NUM_TASKS"]
    if tasks < 1 or not 0 <= rank < tasks:
        raise UsageError(f"SLURM_PROCID={rank} is not a task of the step's SLURM_STEP_NUM_TASKS={tasks}; {fix}")
    return rank, tasks


def cluster_resolver(cfg, tf):
    """TF_CONFIG when it is set (Kubeflow's TFJob writes it, chief included), else the Slurm job step's variables."""
    if os.environ.get("TF_CONFIG"):
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
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
