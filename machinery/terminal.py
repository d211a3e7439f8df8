"""What the terminal shows besides Keras's own progress: TensorFlow's start-up notices held back, the summary for
people at the end, in the tutorial's step order (docs/terminal.md), and every command's one error line."""

import contextlib
import os
import sys
import tempfile

from machinery.phase_clock import ends


def stopped(status, problem):
    """A command's one line for why it stopped early, `error: <problem>; <fix>` on stderr; returns its exit status
    (README, "Exit codes")."""
    print(f"error: {problem}", file=sys.stderr)
    return status


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
def startup_output_held(verbose, explained=()):
    """Holds back what reaches file descriptor 2 (C++ and Python alike) while the block runs, then shows it
    without TensorFlow's start-up notices: all of it with `verbose`, or when the block fails. A failure of an
    `explained` kind, and a stop (Ctrl-C, or SIGTERM raised as sigterm.Stopped), drop it instead (unless
    `verbose`): the one line that follows says what happened."""
    sys.stderr.flush()
    saved = os.dup(2)
    held = tempfile.TemporaryFile()
    failed, dropped = True, False
    try:
        os.dup2(held.fileno(), 2)
        yield
        failed = False
    except explained:
        dropped = True
        raise
    except Exception:
        raise
    except BaseException:
        dropped = True
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        lines = held.read().decode(errors="replace").splitlines(keepends=True)
        held.close()
        if not verbose:
            lines = [] if dropped else lines if failed else without_startup_notices(lines)
        sys.stderr.write("".join(lines))
        sys.stderr.flush()


@ends("tensorflow")
def start_tensorflow(verbose):
    """Imports TensorFlow and lets it probe for GPUs, which is where CUDA reports, its notices held back."""
    # TensorFlow's C++ INFO and WARNING lines once it runs (input-pipeline notices); errors still show. Read as its
    # libraries load; it does not reach the notices above. A user's setting wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with startup_output_held(verbose):
        import tensorflow as tf

        tf.config.list_physical_devices()
    return tf


# ---------------------------------------------------------------- the summary for people

def short_device(name):
    return name.rsplit("/device:", 1)[-1]


def trained_line(results, resumed=None):
    """`resumed` says where a resumed run started (resume.Plan.describe)."""
    first, epochs, steps = results["resumed_from_step"], results["epochs"], results["steps_per_epoch"]
    if first >= epochs * steps:
        return f"all {epochs} epochs were in the backup; nothing left to train"
    epoch = first // steps + 1
    done = f"epochs {epoch}-{epochs}" if epoch < epochs else f"epoch {epochs}"
    resumed = f"resumed at {resumed}: " if resumed else ""
    return f"{resumed}{done} of {epochs} at {results['train_images_per_s']:,.0f} images/s"


def input_line(inputs):
    """How the splits were read (results.json's `input`), for people: "held in memory", "streamed from disk" or
    each split's own."""
    said = {"resident": "held in memory", "streamed": "streamed from disk"}
    if len(set(inputs.values())) == 1:
        return said[inputs["train"]]
    return ", ".join(f"{split} {said[how]}" for split, how in inputs.items())


def summary(cfg, results, *, num_train, num_test, is_chief, resumed=None):
    """A few lines for people, after the JSON for programs, in the order of the tutorial's steps; `resumed`
    says where a resumed run started."""
    replicas = results["replicas"]
    validation = ", validated each epoch" if cfg.validation else ""
    lines = [
        "Summary, in the tutorial's steps:",
        f"  1. strategy  {results['strategy']}: {replicas} replica{'s' * (replicas != 1)} in sync "
        f"on {', '.join(map(short_device, results['devices']))}",
        f"  2. data      {results['dataset']}: {num_train:,} training and {num_test:,} test images "
        f"({input_line(results['input'])}), global batch {results['global_batch_size']}, "
        f"{results['steps_per_epoch']} steps an epoch",
        f"  3. model     build_model() of model.py, {results['parameters']:,} parameters, compiled in the strategy's scope"
        + ("" if results["dtype_policy"] == "float32" else f", {results['dtype_policy']}"),
        f"  4. training  {trained_line(results, resumed)}{validation}; tensorboard --logdir {cfg.path(cfg.log_dir)}",
        f"  5. restore   latest checkpoint in {cfg.path(cfg.checkpoint_dir)}: "
        f"test accuracy {results['eval_accuracy_checkpoint']:.4f}",
        f"  6. export    {cfg.path(cfg.saved_model_dir)} reloaded: test accuracy "
        f"{results['eval_accuracy_unreplicated']:.4f}, {results['eval_accuracy_replicated']:.4f} in the strategy's "
        "scope; " + (f"Keras 3 file {cfg.path(cfg.keras_model_file)}" if results["keras_model_unsaved"] is None
                     else f"no Keras 3 file: {results['keras_model_unsaved']}"),
        f"  figures      {cfg.path(cfg.results_file)}" + ("" if is_chief else " (written by the chief)"),
    ]
    return "\n".join(lines)
