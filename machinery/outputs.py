"""What a run leaves in --output-dir: a fresh start, a resumed one or a refusal, and at the end the figures of
results.json, written atomically, after which the backup is removed (README, "Outputs"); and what a write that
found the disk full says."""

import errno
import json
import os
import shutil
import tempfile

from machinery.exits import UsageError
from machinery import tf_private


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


def clear_and_make_work_dir(cfg, is_chief):
    """For the chief, clears earlier outputs from --output-dir (clear_outputs: an unfinished run's backup stays, to
    resume from); returns where this process writes: --output-dir for the chief; another worker writes to a
    folder of its own in the process's temporary folder (machinery/scratch.py), removed with it at the end. (Keras's
    ModelCheckpoint and BackupAndRestore send a non-chief's writes elsewhere themselves.)"""
    if is_chief:
        clear_outputs(cfg)
    os.makedirs(cfg.output_dir, exist_ok=True)
    return cfg.output_dir if is_chief else tempfile.mkdtemp(prefix="mnist-worker-")


def device_names(strategy):
    """The devices the strategy trains on. The default strategy (--strategy default) has none of its own: its
    worker_devices raises RuntimeError, and TensorFlow places its work on the first GPU, else on the CPU."""
    import tensorflow as tf

    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:
        return [(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))[0].name]


def peak_gpu_memory_mb(strategy):
    """The most memory TensorFlow's allocator held on each of the strategy's GPUs so far; None without GPUs.
    With the default allocator TensorFlow reserves nearly all of a GPU at start, so nvidia-smi cannot tell."""
    import tensorflow as tf

    gpus = [name.rsplit("device:", 1)[-1] for name in device_names(strategy) if "GPU" in name.upper()]
    return {gpu: round(tf.config.experimental.get_memory_info(gpu)["peak"] / 2**20, 1) for gpu in gpus} or None


def results(cfg, strategy, *, parameters, global_batch, plan, train_images, timing, accuracies, learning_rate_scale,
            inputs, keras_unsaved=None, phase_ends=None):
    """The figures of results.json; `plan` is where training started (resume.Plan), `timing` is `fit`'s wall and
    CPU seconds and each of its epochs' wall seconds, `accuracies` are the checkpoint's, the reloaded
    SavedModel's, and the SavedModel's reloaded in the strategy's scope; `inputs` how each split was read
    ({"train": "resident" or "streamed", "test": ...}); `keras_unsaved` why Keras could not save the Keras 3 file
    (None when it did); `phase_ends` the Unix time at which each of the run's
    phases so far ended, in order."""
    train_seconds, train_cpu_seconds, epoch_seconds = timing
    checkpoint, unreplicated, replicated = accuracies
    return {
        "dataset": cfg.dataset,
        "input": inputs,
        "strategy": cfg.strategy,
        "replicas": strategy.num_replicas_in_sync,
        "devices": device_names(strategy),
        "parameters": parameters,
        "epochs": cfg.epochs,
        "global_batch_size": global_batch,
        "steps_per_epoch": plan.steps,
        "resumed_from_epoch": plan.epoch,
        "resumed_from_step": plan.first_global_step,
        "resumed_after_images": plan.resumed_after_images,
        "train_images": train_images,
        "train_seconds": round(train_seconds, 3),
        "train_images_per_s": round(train_images / train_seconds, 1) if train_seconds else None,
        "train_cpu_seconds": round(train_cpu_seconds, 3),
        "train_epoch_seconds": epoch_seconds,
        "peak_gpu_memory_mb": peak_gpu_memory_mb(strategy),
        "eval_accuracy_checkpoint": float(checkpoint),
        "eval_accuracy_unreplicated": float(unreplicated),
        "eval_accuracy_replicated": float(replicated),
        "seed": cfg.seed,
        "learning_rate_scale": learning_rate_scale,
        "warmup_epochs": cfg.warmup_epochs,
        "cross_device_ops": cfg.cross_device_ops or "default",
        "communication": cfg.communication or "default",
        # Each step's figures under multiworker: all workers', as Keras computes them (a former option's field).
        "step_metrics": "all" if cfg.strategy == "multiworker" else None,
        "allreduce_dtype": cfg.allreduce_dtype if cfg.strategy == "multiworker" else None,
        "dtype_policy": cfg.dtype_policy,  # Keras's: float32, mixed_float16 or mixed_bfloat16
        "gpu_memory_growth": cfg.gpu_memory_growth,
        "keras_model_unsaved": keras_unsaved,
        "phase_ends": {name: round(stamp, 3) for name, stamp in (phase_ends or {}).items()},
    }


def write_json(path, payload):
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(partial, path)


def finish(cfg, figures, *, is_chief):
    """The chief writes results.json, and only then removes the backup: a kill before that resumes from it."""
    if is_chief:
        write_json(cfg.path(cfg.results_file), figures)
        from machinery import resume

        resume.discard(cfg.path(cfg.backup_dir))


# ---------------------------------------------------------------- a full disk

def unwritten_file(err):
    """The file a write failed on for want of space, when `err` or an exception behind it is that failure ("" if
    it names none); None for any other error. Python's writes raise OSError with ENOSPC, TensorFlow's say so in
    their message (tf_private.no_space_for)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return os.fsdecode(err.filename or "")
        unwritten = tf_private.no_space_for(str(err))
        if unwritten is not None:
            return unwritten
        err = err.__cause__ or err.__context__
    return None


def mount_point(path):
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def no_space(cfg, err):
    """One line for a run stopped by a full disk, naming the file system and how full it is; None for any other
    error. Exit 2, as for bad input (README, "Exit codes"): a restart on the same disk would fail the same way, and
    one once there is room resumes from the last backup, which the failed write left as it was."""
    unwritten = unwritten_file(err)
    if unwritten is None:
        return None
    # Python's zip and h5 writers name no file; the run was writing in --output-dir then.
    folder = os.path.dirname(unwritten) if unwritten else (cfg.output_dir if cfg else os.getcwd())
    mount = mount_point(folder)
    usage = shutil.disk_usage(mount)
    return (f"no space left on the file system at {mount} ({usage.free / 2**20:.1f} MB free of "
            f"{usage.total / 2**20:.1f} MB) writing in {folder}; free some space there, or "
            f"choose an --output-dir with more room (sizes in docs/faults.md, \"A full disk\"), then run the same "
            f"command again: it resumes from the last backup")
