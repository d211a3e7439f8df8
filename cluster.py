"""Where the workers come from, and how a lost one is recognised (beside the tutorial's step 1).

`--strategy multiworker` reads its cluster from TF_CONFIG (Kubeflow's TFJob writes it) or, without it, from the
variables Slurm's srun sets for each task. Each worker warns that its port is open, and a run that loses a worker
is told apart from any other failure so that it can exit with a retryable status (README, "Exit codes").
"""

import os
import re
import shutil
import sys

import config
from config import UsageError


def cluster_resolver(cfg, tf):
    """TF_CONFIG when it is set (Kubeflow's TFJob writes it, chief included), else the Slurm job step's variables."""
    if os.environ.get("TF_CONFIG"):
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    try:
        if slurm_node_has_gpus():
            # TensorFlow's resolver counts the node's GPUs and gives each task its share in CUDA_VISIBLE_DEVICES.
            slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=cfg.slurm_port_base)
            slurm.cluster_spec()
            show_only_gpus(os.environ["CUDA_VISIBLE_DEVICES"], tf)
            return slurm
        # Told "no GPUs", TensorFlow's resolver lists no tasks at all (it hands out one port per GPU share), so
        # give it one share per task, keep its cluster and task, and tell the strategy there are no GPUs.
        tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
        slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=cfg.slurm_port_base, gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False)
        cluster = slurm.cluster_spec()
        task_type, task_id = slurm.get_task_info()
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, task_type=task_type, task_id=task_id, rpc_layer=slurm.rpc_layer, num_accelerators={"GPU": 0})
    except (ValueError, RuntimeError) as err:
        # TensorFlow's resolver raises these for host or tasks-per-node lists it cannot read, or that disagree.
        raise UsageError(f"the Slurm variables do not describe this job step ({err}); start one task per worker "
                         "with srun inside the job (docs/clusters.md, \"Slurm\"), or set TF_CONFIG") from None


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


def warn_open_port(resolver):
    """TensorFlow's gRPC server binds every interface, whatever host the cluster names, and checks no identity."""
    task_type, task_id = resolver.task_type, resolver.task_id
    address = resolver.cluster_spec().task_address(task_type, task_id)
    port = int(address.rsplit(":", 1)[1])
    if not 1 <= port <= config.MAX_PORT:
        raise UsageError(f"{task_type} {task_id} would listen on port {port}, which does not exist; "
                         "choose a lower --slurm-port-base, or fix the ports in TF_CONFIG")
    print(f"warning: {task_type} {task_id} listens on port {port} on every network interface, unauthenticated "
          "(TensorFlow's gRPC server); run multi-worker training only on a trusted network or behind a firewall "
          "(docs/clusters.md, \"Open ports\")", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- a lost peer

# Measured with two workers on loopback: a peer's process killed, or stopped so that its heartbeats stop,
# aborts every collective op here with UnavailableError (within 1 s, or 6 s for the heartbeats); the peer
# hosting the coordination service stopped gives DeadlineExceededError on its heartbeat (11 s). So no
# collective timeout is needed for a survivor to leave. TensorFlow names the lost task in the message.
PEER_TASK = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
ABORTED_BY = "Collective ops is aborted by:"


def lost_peer(cfg, err):
    """What was lost, when `err` is a multi-worker run losing one of its workers; None for any other error."""
    tf = sys.modules.get("tensorflow")
    if cfg is None or cfg.strategy != "multiworker" or tf is None:
        return None
    if not isinstance(err, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
        return None
    task = PEER_TASK.search(err.message)
    what = f"{task[1]} {task[2]}" if task else "the worker hosting the coordination service (the chief, or worker 0)"
    reason = err.message.split(ABORTED_BY)[-1].strip().splitlines()[0].rstrip(":")
    return f"lost {what} of this multi-worker run ({reason})"
