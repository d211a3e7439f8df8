"""TensorFlow's "Distributed training with Keras" tutorial as one script.

Steps, in the tutorial's order: (1) the distribution strategy, (2) MNIST through tfds, (3) the model
compiled inside `strategy.scope()`, (4) `fit` with TensorBoard, per-epoch checkpoints, the learning-rate
schedule and a printed learning rate, (5) the latest checkpoint restored and evaluated, (6) a SavedModel
exported and reloaded without and with the strategy's scope, both evaluated, and a model.keras for Keras 3.
Figures go to results.json; a short summary for people follows them.
"""

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

# TensorFlow's C++ INFO and WARNING lines once it runs (input-pipeline notices); errors still show. This does
# not reach the notices TensorFlow prints while it starts: see start_tensorflow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import config
from config import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_LOST, EXIT_PREEMPTED, Preempted, UsageError


# ---------------------------------------------------------------- TensorFlow's start-up

# Lines TensorFlow 2.21 prints from C++ while it loads and probes for GPUs, before its logging is set up, so
# TF_CPP_MIN_LOG_LEVEL does not reach them: notices nobody can act on. --verbose shows them.
STARTUP_NOTICES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "] oneDNN custom operations are on.",
    "] Could not find cuda drivers on your machine, GPU will not be used.",
)
NO_CUDA_DRIVER = STARTUP_NOTICES[2]
# Without any CUDA driver (the notice above) this failure follows as a matter of course; with a driver it is
# a real error, and shown.
CUINIT_FAILED = "] failed call to cuInit:"


def without_startup_notices(lines):
    no_driver = any(NO_CUDA_DRIVER in line for line in lines)
    return [line for line in lines
            if not any(notice in line for notice in STARTUP_NOTICES) and not (no_driver and CUINIT_FAILED in line)]


@contextlib.contextmanager
def startup_output_held(verbose):
    """Holds back what reaches file descriptor 2 (C++ and Python alike) while the block runs, then shows it
    without TensorFlow's start-up notices: all of it with `verbose`, or when the block fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    held = tempfile.TemporaryFile()
    failed = True
    try:
        os.dup2(held.fileno(), 2)
        yield
        failed = False
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        lines = held.read().decode(errors="replace").splitlines(keepends=True)
        held.close()
        sys.stderr.write("".join(lines if verbose or failed else without_startup_notices(lines)))
        sys.stderr.flush()


def start_tensorflow(verbose):
    """Imports TensorFlow and lets it probe for GPUs, which is where CUDA reports, its notices held back."""
    with startup_output_held(verbose):
        import tensorflow as tf

        tf.config.list_physical_devices()
    return tf


# ---------------------------------------------------------------- step 1: the strategy

def cross_device_ops(cfg, tf):
    """MirroredStrategy's all-reduce; None lets TensorFlow choose (NCCL between GPUs, else reduce-to-one).

    The other two avoid NCCL where it is missing (Windows) or hangs (IOMMU on); README, "The all-reduce".
    """
    choices = {"nccl": tf.distribute.NcclAllReduce, "hierarchical-copy": tf.distribute.HierarchicalCopyAllReduce,
               "reduce-to-one": tf.distribute.ReductionToOneDevice}
    return choices[cfg.cross_device_ops]() if cfg.cross_device_ops else None


def communication_options(cfg, tf):
    """MultiWorkerMirroredStrategy's collective options; AUTO (TensorFlow's choice) when unset."""
    implementation = tf.distribute.experimental.CommunicationImplementation
    choices = {"auto": implementation.AUTO, "ring": implementation.RING, "nccl": implementation.NCCL}
    return tf.distribute.experimental.CommunicationOptions(implementation=choices[cfg.communication or "auto"])


def refuse_nccl_without_gpus(cfg, tf):
    """NCCL only moves tensors between GPUs; on CPU tensors it would fail once training starts, not now."""
    flag = ("--cross-device-ops" if cfg.cross_device_ops == "nccl"
            else "--communication" if cfg.communication == "nccl" else None)
    if flag is None:
        return
    others = "hierarchical-copy or reduce-to-one" if flag == "--cross-device-ops" else "ring or auto"
    if not tf.config.list_physical_devices("GPU"):
        raise UsageError(f"{flag} nccl all-reduces between GPUs and this machine has none; use {others}")
    not_gpus = [d for d in cfg.device_list or [] if tf.DeviceSpec.from_string(d).device_type != "GPU"]
    if not_gpus:
        raise UsageError(f"{flag} nccl all-reduces between GPUs, but --devices names {', '.join(not_gpus)}; "
                         f"name GPUs only, or use {others}")


def make_strategy(cfg, tf):
    """Logical CPU devices and GPU memory growth must be set before TensorFlow's runtime starts, hence first of all."""
    refuse_nccl_without_gpus(cfg, tf)
    if cfg.gpu_memory_growth:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    if cfg.cpu_replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cfg.cpu_replicas)
    if cfg.strategy == "multiworker":
        resolver = cluster_resolver(cfg, tf)
        warn_open_port(resolver)
        # TF 2.0's tf.distribute.experimental.MultiWorkerMirroredStrategy.
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                         communication_options=communication_options(cfg, tf))
    if cfg.strategy == "default":
        return tf.distribute.get_strategy()
    if cfg.device_list:
        # MirroredStrategy would accept a device this machine lacks and quietly place work elsewhere.
        known = {tf.DeviceSpec.from_string(d.name).replace(job=None, replica=None, task=None).to_string().lower()
                 for d in tf.config.list_logical_devices()}
        missing = [d for d in cfg.device_list if tf.DeviceSpec.from_string(d).to_string().lower() not in known]
        if missing:
            raise UsageError(f"--devices names {', '.join(missing)}, which this machine does not have; "
                             f"choose from {', '.join(sorted(known))}")
    return tf.distribute.MirroredStrategy(devices=cfg.device_list, cross_device_ops=cross_device_ops(cfg, tf))


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
                         "with srun inside the job (README, \"Slurm\"), or set TF_CONFIG") from None


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
          "(README, \"Open ports\")", file=sys.stderr, flush=True)


def device_names(strategy):
    return list(getattr(strategy.extended, "worker_devices", ["/cpu:0"]))


# ---------------------------------------------------------------- outputs: fresh, resumed or refused

def refuse_finished_run(cfg):
    """A finished run's outputs are never mixed with a new run's, unless --overwrite says to replace them."""
    if os.path.exists(cfg.path(cfg.results_file)) and not cfg.overwrite:
        raise UsageError(f"{cfg.output_dir} already holds a finished run ({cfg.results_file}); "
                         "pass --overwrite to replace it, or choose another --output-dir")


def clear_outputs(cfg):
    """Removes earlier outputs, unless an unfinished run's backup is there to resume from (and no --overwrite)."""
    unfinished = os.path.isdir(cfg.path(cfg.backup_dir)) and not os.path.exists(cfg.path(cfg.results_file))
    if unfinished and not cfg.overwrite:
        return
    for name in (cfg.checkpoint_dir, cfg.log_dir, cfg.backup_dir, cfg.results_file):
        path = cfg.path(name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def write_json(path, payload):
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(partial, path)


# ---------------------------------------------------------------- the summary for people

def short_device(name):
    return name.rsplit("/device:", 1)[-1]


def trained_line(results):
    first, epochs, steps = results["resumed_from_step"], results["epochs"], results["steps_per_epoch"]
    if first >= epochs * steps:
        return f"all {epochs} epochs were in the backup; nothing left to train"
    epoch = first // steps + 1
    done = f"epochs {epoch}-{epochs}" if epoch < epochs else f"epoch {epochs}"
    resumed = f"resumed at epoch {epoch}, step {first % steps}: " if first else ""
    return f"{resumed}{done} of {epochs} at {results['train_images_per_s']:,.0f} images/s"


def summary(cfg, results, *, num_train, num_test, is_chief):
    """A few lines for people, after the JSON for programs, in the order of the tutorial's steps."""
    replicas = results["replicas"]
    validation = ", validated each epoch" if cfg.validation else ""
    lines = [
        "Summary, in the tutorial's steps:",
        f"  1. strategy  {results['strategy']}: {replicas} replica{'s' * (replicas != 1)} in sync "
        f"on {', '.join(map(short_device, results['devices']))}",
        f"  2. data      MNIST: {num_train:,} training and {num_test:,} test images, global batch "
        f"{results['global_batch_size']}, {results['steps_per_epoch']} steps an epoch",
        f"  4. training  {trained_line(results)}{validation}; tensorboard --logdir {cfg.path(cfg.log_dir)}",
        f"  5. restore   latest checkpoint in {cfg.path(cfg.checkpoint_dir)}: "
        f"test accuracy {results['eval_accuracy_checkpoint']:.4f}",
        f"  6. export    {cfg.path(cfg.saved_model_dir)} reloaded: test accuracy "
        f"{results['eval_accuracy_unreplicated']:.4f}, {results['eval_accuracy_replicated']:.4f} in the strategy's "
        f"scope; Keras 3 file {cfg.path(cfg.keras_model_file)}",
        f"  figures      {cfg.path(cfg.results_file)}" + ("" if is_chief else " (written by the chief)"),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the run

def run(cfg):
    tf = start_tensorflow(cfg.verbose)
    strategy = make_strategy(cfg, tf)
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # Imported here rather than at the top, so that a bad flag is reported before TensorFlow loads, and after
    # the strategy, which (for multi-worker) must exist before anything else touches the runtime.
    import callbacks
    import data
    import export
    from model import build_model, compile_model, keras, use_mixed_precision

    # From here on SIGTERM saves and stops training at the next step boundary, or ends the run at once when
    # it is not training (exit 143 either way).
    preemption = callbacks.Preemption()
    preemption.install()
    keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()

    # Keras's ModelCheckpoint and BackupAndRestore themselves send a non-chief's writes to a temporary folder.
    checkpoint_dir = cfg.path(cfg.checkpoint_dir)
    backup_dir = cfg.path(cfg.backup_dir)

    # Step 2: the data, read before any output is touched so that a bad --data-dir changes nothing. Both splits
    # are held in memory (47 MB) and batches gathered from there: the tutorial's per-example stream cost most of
    # the first epoch (README, "Speed").
    _, info = data.load(cfg.data_dir, cfg.idx_dir)
    arrays = {split: data.resident_split(info, split) for split in ("train", "test")}

    # Only the chief writes where the user asked; other workers write to a folder they remove at the end.
    is_chief = strategy.extended.should_checkpoint
    if is_chief:
        clear_outputs(cfg)
    os.makedirs(cfg.output_dir, exist_ok=True)
    work_dir = cfg.output_dir if is_chief else tempfile.mkdtemp(prefix="mnist-worker-")
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    num_train = info.splits["train"].num_examples
    steps = data.steps_per_epoch(num_train, global_batch, cfg.steps_per_epoch)
    first_epoch, first_step = callbacks.backed_up_position(backup_dir, steps)
    train = data.distribute(strategy, data.train_dataset(
        *arrays["train"], buffer_size=cfg.buffer_size, global_batch=global_batch, seed=cfg.seed,
        first_epoch=first_epoch, first_step=first_step, epochs=cfg.epochs, steps=steps))
    test = data.eval_dataset(*arrays["test"], global_batch=global_batch)

    # Step 3: the model, inside the strategy's scope.
    if cfg.mixed_precision:
        use_mixed_precision()
    learning_rate = callbacks.learning_rate(cfg, global_batch=global_batch, steps_per_epoch=steps)
    with strategy.scope():
        model = compile_model(build_model(), steps_per_execution=cfg.steps_per_execution,
                              jit_compile=cfg.jit_compile, fused_adam=cfg.fused_adam, learning_rate=learning_rate)

    # Step 4: training. A resumed run starts at the step after the last one backed up.
    first_global_step, last_global_step = first_epoch * steps + first_step, cfg.epochs * steps
    if first_global_step:
        print(f"Resuming from the backup in {backup_dir} at epoch {first_epoch + 1}, step {first_step}")
    train_seconds, train_images = 0.0, 0
    if first_global_step < last_global_step:
        cbs = callbacks.make_callbacks(cfg, log_dir=os.path.join(work_dir, cfg.log_dir), checkpoint_dir=checkpoint_dir,
                                       backup_dir=backup_dir, steps_per_epoch=steps, preemption=preemption)
        start = time.perf_counter()
        # Keras's BackupAndRestore restores the same position from the same backup; initial_epoch only says so.
        # With --validation, Keras evaluates the test split at each epoch's end; TensorBoard's callback writes
        # those figures to a `validation` run beside `train`.
        model.fit(train, epochs=cfg.epochs, initial_epoch=first_epoch, steps_per_epoch=steps, callbacks=cbs,
                  validation_data=test if cfg.validation else None)
        train_seconds = time.perf_counter() - start
        train_images = data.images_in_steps(first_global_step, last_global_step, steps, global_batch, num_train)

    # Step 5: the latest checkpoint, restored and evaluated. A non-chief that just trained skips the restore:
    # synchronous training left it the chief's weights, and the chief may still be writing that checkpoint.
    if is_chief or not train_images:
        # The checkpoint also holds the optimizer, which evaluation does not need.
        model.load_weights(tf.train.latest_checkpoint(checkpoint_dir)).assert_existing_objects_matched().expect_partial()
    _, accuracy_checkpoint = model.evaluate(test)

    # Step 6: export, reload without and with the strategy's scope, evaluate both; and the Keras 3 file.
    saved_model = os.path.join(work_dir, cfg.saved_model_dir)
    export.export(model, saved_model)
    export.export_keras(model, os.path.join(work_dir, cfg.keras_model_file))
    _, accuracy_unreplicated = export.reload(saved_model).evaluate(test)
    _, accuracy_replicated = export.reload(saved_model, strategy).evaluate(test)

    results = {
        "strategy": cfg.strategy,
        "replicas": strategy.num_replicas_in_sync,
        "devices": device_names(strategy),
        "epochs": cfg.epochs,
        "global_batch_size": global_batch,
        "steps_per_epoch": steps,
        "resumed_from_epoch": first_epoch,
        "resumed_from_step": first_global_step,
        "train_images": train_images,
        "train_seconds": round(train_seconds, 3),
        "train_images_per_s": round(train_images / train_seconds, 1) if train_seconds else None,
        "eval_accuracy_checkpoint": float(accuracy_checkpoint),
        "eval_accuracy_unreplicated": float(accuracy_unreplicated),
        "eval_accuracy_replicated": float(accuracy_replicated),
        "seed": cfg.seed,
        "learning_rate_scale": callbacks.learning_rate_scale(global_batch, cfg.scale_lr),
        "warmup_epochs": cfg.warmup_epochs,
        "cross_device_ops": cfg.cross_device_ops or "default",
        "communication": cfg.communication or "default",
        "mixed_precision": cfg.mixed_precision,
        "gpu_memory_growth": cfg.gpu_memory_growth,
    }
    if is_chief:
        write_json(cfg.path(cfg.results_file), results)
        # The run is complete only now; a kill before this line resumes from the backup.
        shutil.rmtree(backup_dir, ignore_errors=True)
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(results, indent=2))
    print()
    print(summary(cfg, results, num_train=num_train, num_test=info.splits["test"].num_examples, is_chief=is_chief))
    return EXIT_OK


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


def main(argv=None):
    parser = config.build_parser("train_mnist_mirrored.py", __doc__)
    args = parser.parse_args(argv)
    cfg = None
    try:
        cfg = config.validate(config.from_args(args))
        refuse_finished_run(cfg)
        return run(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Preempted as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume after the last backup", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        lost = lost_peer(cfg, err)
        if lost is None:
            raise
        print(f"error: {lost}; restart every worker with the same command: the run resumes from the last backup",
              file=sys.stderr)
        # TensorFlow's runtime is unusable after a collective abort ("Restart your program to reset"), and
        # tearing it down waits on the input pipeline's threads (measured: 7-30 s). Every epoch's checkpoint
        # and backup is already complete on disk, so leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)


if __name__ == "__main__":
    sys.exit(main())
