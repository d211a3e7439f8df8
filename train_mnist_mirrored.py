"""TensorFlow's "Distributed training with Keras" tutorial as one script.

Steps, in the tutorial's order: (1) the distribution strategy, (2) the dataset through tfds (MNIST, or the one
--dataset names), (3) the model compiled inside `strategy.scope()`, (4) `fit` with TensorBoard, per-epoch
checkpoints, the learning-rate schedule and a printed learning rate, (5) the latest checkpoint restored and
evaluated, (6) a SavedModel exported and reloaded without and with the strategy's scope, both evaluated, and a
model.keras for Keras 3.
Figures go to results.json; a short summary for people follows them.
"""

import json
import os
import time

# When this module started running: the end of the interpreter's start, the first of a run's phases.
MODULE_STARTED = time.time()


# TensorFlow's CPU tensors from its own BFC allocator, which keeps freed memory for the next step, instead of
# malloc, with which each step of a multi-worker run paid for fresh pages, zeroed by the kernel, then unmapped
# (docs/history.md, "Several workers"). Read when TensorFlow makes its first CPU device; a user's setting wins.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# `tf.keras` is tf_keras, the Keras the run uses: TensorFlow then loads tf_keras's optimizers as it starts, and
# not Keras 3's, which the run never uses (docs/performance.md).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import config
from machinery import gpu_box
from machinery import outputs
from machinery import run_lock
from machinery import scratch
from machinery import sigterm
from machinery import terminal
from machinery import worker_group
from machinery import worker_sources
from machinery.exits import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_LOST, EXIT_PREEMPTED,
                             ClusterNotFormed, Preempted, UsageError)
from machinery.phase_clock import PhaseClock, ends

# ---------------------------------------------------------------- step 1: the strategy

def cross_device_ops(cfg, tf):
    """MirroredStrategy's all-reduce; None lets TensorFlow choose (NCCL between GPUs, else reduce-to-one).

    The other two avoid NCCL where it is missing (Windows) or hangs (IOMMU on); docs/multi-gpu.md, "The all-reduce".
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


def refuse_xla_collectives_on_cpus(cfg, tf):
    """XLA compiles no all-reduce between CPU workers (docs/upstream/xla_cpu_collectives.py): the train step would
    fail and both workers abort once training starts. Between GPUs it compiles."""
    if cfg.jit_compile and cfg.strategy == "multiworker" and not tf.config.list_physical_devices("GPU"):
        raise UsageError("--jit-compile cannot compile the all-reduce between --strategy multiworker's workers on "
                         "CPUs (XLA has no CPU collectives) and this machine has no GPU; drop --jit-compile, or "
                         "train on one machine with --strategy mirrored")


@ends("strategy")
def make_strategy(cfg, tf):
    """Logical CPU devices and GPU memory growth must be set before TensorFlow's runtime starts, hence first of all."""
    gpu_box.refuse_silent_cpu_run(cfg, tf)
    refuse_nccl_without_gpus(cfg, tf)
    refuse_xla_collectives_on_cpus(cfg, tf)
    if cfg.gpu_memory_growth:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    if cfg.cpu_replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cfg.cpu_replicas)
    if cfg.strategy == "multiworker":
        resolver = worker_sources.cluster_resolver(cfg, tf)
        worker_group.check_port_and_warn_open(resolver)
        # TF 2.0's tf.distribute.experimental.MultiWorkerMirroredStrategy, made once every worker is there.
        return worker_group.form(resolver, lambda: tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=communication_options(cfg, tf)),
            tf, timeout=cfg.cluster_timeout, verbose=cfg.verbose)
    if cfg.strategy == "default":
        return tf.distribute.get_strategy()
    if cfg.device_list:
        # MirroredStrategy would accept a device this machine lacks and quietly place work elsewhere.
        known = {tf.DeviceSpec.from_string(d.name).replace(job=None, replica=None, task=None).to_string().lower()
                 for d in tf.config.list_logical_devices()}
        named = [tf.DeviceSpec.from_string(d).to_string().lower() for d in cfg.device_list]
        missing = [d for d, name in zip(cfg.device_list, named) if name not in known]
        if missing:
            raise UsageError(f"--devices names {', '.join(missing)}, which this machine does not have; "
                             f"choose from {', '.join(sorted(known))}")
        if len(set(named)) < len(named):  # MirroredStrategy's own check is an assert
            raise UsageError(f"--devices {cfg.devices} names a device more than once; name each once")
    return tf.distribute.MirroredStrategy(devices=cfg.device_list, cross_device_ops=cross_device_ops(cfg, tf))


# ---------------------------------------------------------------- the steps after the strategy

@ends("libraries")
def import_steps():
    """The steps' modules, and with them tf_keras and tfds: imported after the strategy, which (for multi-worker)
    must exist before anything else touches TensorFlow's runtime, and not at the top, so that a bad flag is
    reported before TensorFlow loads."""
    global callbacks, data, export, resume, keras, build_model, compile_model, use_mixed_precision
    import callbacks
    import data
    import export
    from machinery import resume
    from model import build_model, compile_model, keras, use_mixed_precision


@ends("data")
def read_data(cfg, strategy, global_batch):
    """Step 2: the dataset's DatasetInfo, its training split and what the evaluations read of its test split, each
    split held in memory or streamed (data.split)."""
    info = data.load(cfg.dataset, cfg.data_dir, cfg.idx_dir)
    train, test = (data.split(info, name, limit_mb=cfg.resident_limit_mb) for name in ("train", "test"))
    return info, train, data.eval_input(strategy, test, global_batch=global_batch)


def make_variables(tf, model, features):
    """A model that makes its variables at its first call (a subclassed one) makes them now, called on one example
    of zeros shaped as `features` (a spec): the backup's check, the restore and the parameter count read them."""
    if not model.built:
        model(tf.nest.map_structure(lambda spec: tf.zeros((1, *spec.shape), spec.dtype), features), training=False)


@ends("model")
def build(cfg, tf, strategy, info, train, plan, global_batch):
    """Step 3: the model of model.py, built for what step 2 yields and compiled inside the strategy's scope; then
    step 2's training half, from the plan's position. Returns the model and what `fit` reads."""
    if cfg.mixed_precision:
        use_mixed_precision(cfg.dtype_policy)
    learning_rate = callbacks.learning_rate(cfg, global_batch=global_batch, steps_per_epoch=plan.steps,
                                            step_offset=plan.step_offset)
    with strategy.scope():
        model = compile_model(build_model(*data.model_input(train, info)),
                              steps_per_execution=cfg.steps_per_execution,
                              jit_compile=cfg.jit_compile, fused_adam=cfg.fused_adam, learning_rate=learning_rate,
                              allreduce_dtype=cfg.allreduce_dtype)
        make_variables(tf, model, train.element_spec[0])
    # A backup this model or optimizer cannot continue is refused before training writes anything.
    resume.refuse_another_model(cfg, plan, model)
    # `fit` reads the batches from the first image the backup had not trained.
    return model, data.training_input(strategy, train, plan.stream(cfg.epochs))


@ends("fit")
def fit(cfg, model, train, test, *, plan, work_dir, preemption):
    """Step 4's `fit` with the tutorial's callbacks and the backup, from the plan's position. Returns the images
    it trained, and its wall seconds, the CPU seconds this process spent meanwhile (all its threads) and each
    epoch's wall seconds, which the benchmarks read; nothing when the backup had trained every epoch."""
    images = plan.train_images(cfg.epochs)
    if not images:
        return images, (0.0, 0.0, [])
    clock = callbacks.EpochClock()
    cbs = callbacks.make_callbacks(cfg, log_dir=os.path.join(work_dir, cfg.log_dir),
                                   checkpoint_dir=cfg.path(cfg.checkpoint_dir), backup_dir=cfg.path(cfg.backup_dir),
                                   plan=plan, preemption=preemption)
    start, start_cpu = time.perf_counter(), time.process_time()
    # The backup callback sets Keras's own counters to the plan's epoch and step; initial_epoch says the same.
    # With --validation, Keras evaluates the test split at each epoch's end; TensorBoard's callback writes
    # those figures to a `validation` run beside `train`.
    validation = dict(validation_data=test.dataset, validation_steps=test.steps) if cfg.validation else {}
    model.fit(train, epochs=cfg.epochs, initial_epoch=plan.epoch, steps_per_epoch=plan.steps, callbacks=[*cbs, clock],
              **validation)
    return images, (time.perf_counter() - start, time.process_time() - start_cpu, clock.epoch_seconds())


@ends("restore")
def restore_and_evaluate(cfg, tf, model, test, *, restore):
    """Step 5: the latest checkpoint restored into `model` (when `restore`), then its test accuracy."""
    if restore:
        # The checkpoint also holds the optimizer, which evaluation does not need.
        latest = tf.train.latest_checkpoint(cfg.path(cfg.checkpoint_dir))
        model.load_weights(latest).assert_existing_objects_matched().expect_partial()
    return export.accuracy(model, test)


@ends("export")
def export_model(cfg, model, work_dir):
    """Step 6's export: the SavedModel, and the Keras 3 file beside it. Returns the SavedModel's path, and why
    Keras could not save the Keras 3 file (None when it did)."""
    saved_model = os.path.join(work_dir, cfg.saved_model_dir)
    export.export(model, saved_model)
    return saved_model, export.export_keras(model, os.path.join(work_dir, cfg.keras_model_file))


@ends("reload")
def reload_and_evaluate(cfg, saved_model, strategy, test):
    """Step 6's reloads: the SavedModel reloaded without and with the strategy's scope; both test accuracies."""
    return [export.accuracy(export.reload(saved_model, scope, steps_per_execution=cfg.steps_per_execution), test)
            for scope in (None, strategy)]


# ---------------------------------------------------------------- the run

def run(cfg, preemption, phases):
    tf = terminal.start_tensorflow(cfg.verbose)

    # Step 1: the strategy.
    strategy = make_strategy(cfg, tf)
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    global_batch = cfg.batch_size_per_replica * strategy.num_replicas_in_sync
    is_chief = strategy.extended.should_checkpoint
    import_steps()
    keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()

    # Step 2: the data, read before any output is touched, so that a bad --data-dir changes nothing. Where
    # training starts, counted in images, on whatever cluster the backup was made: a restart the backup's
    # position cannot survive is refused here too.
    info, train, test = read_data(cfg, strategy, global_batch)
    plan = resume.start(cfg.path(cfg.backup_dir), resume.Settings.of(cfg, num_examples=train.num_examples,
                                                                     global_batch=global_batch),
                        epochs=cfg.epochs, overwrite=cfg.overwrite)
    work_dir = outputs.clear_and_make_work_dir(cfg, is_chief)

    # Step 3: the model, compiled inside the strategy's scope.
    model, train_input = build(cfg, tf, strategy, info, train, plan, global_batch)

    # Step 4: training, from the first image the backup had not trained.
    if plan.resumed_after_images:
        print(f"Resuming from the backup in {cfg.path(cfg.backup_dir)} at {plan.describe()}")
    trained, timing = fit(cfg, model, train_input, test, plan=plan, work_dir=work_dir, preemption=preemption)

    # Step 5: the latest checkpoint, restored and evaluated. A non-chief that just trained skips the restore:
    # synchronous training left it the chief's weights, and the chief may still be writing that checkpoint.
    accuracy_checkpoint = restore_and_evaluate(cfg, tf, model, test, restore=is_chief or not trained)

    # Step 6: export, reload without and with the strategy's scope, evaluate both; and the Keras 3 file.
    saved_model, keras_unsaved = export_model(cfg, model, work_dir)
    accuracy_unreplicated, accuracy_replicated = reload_and_evaluate(cfg, saved_model, strategy, test)

    figures = outputs.results(
        cfg, strategy, parameters=model.count_params(), global_batch=global_batch, plan=plan, train_images=trained,
        timing=timing, accuracies=(accuracy_checkpoint, accuracy_unreplicated, accuracy_replicated),
        learning_rate_scale=callbacks.learning_rate_scale(global_batch, cfg.scale_lr),
        inputs={"train": train.how, "test": test.how}, keras_unsaved=keras_unsaved, phase_ends=phases.ends)
    preemption.finishing()
    outputs.finish(cfg, figures, is_chief=is_chief)
    print(json.dumps(figures, indent=2))
    print()
    print(terminal.summary(cfg, figures, num_train=train.num_examples, num_test=info.splits["test"].num_examples,
                           is_chief=is_chief, resumed=plan.describe() if plan.resumed_after_images else None))
    return EXIT_OK


def outcome(args, preemption, phases):
    """The run's exit status, and the problem that stopped it early (None when nothing did): terminal.stopped's
    `<problem>; <fix>`."""
    cfg = None
    try:
        cfg = config.validate(config.from_args(args))
        workers = worker_sources.check(cfg, os.environ)
        if workers is None or workers.rank == 0:
            run_lock.take(cfg)  # the chief's, until this process ends
        outputs.refuse_finished_run(cfg)
        # Every temporary file in one folder, removed at every end; a restart of this worker finds it by its name.
        with scratch.kept(f"{os.path.abspath(cfg.output_dir)} worker {workers.rank if workers else 0}"):
            return run(cfg, preemption, phases), None
    except UsageError as err:
        return EXIT_BAD_INPUT, str(err)
    except Preempted as err:
        return EXIT_PREEMPTED, str(err)
    except ClusterNotFormed as err:
        return EXIT_PEER_LOST, str(err)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, "interrupted; run the same command again to resume after the last backup"
    except Exception as err:
        full = outputs.no_space(cfg, err)
        if full is not None:
            return EXIT_BAD_INPUT, full
        lost = worker_group.lost_peer(cfg, err)
        if lost is None:
            raise
        return EXIT_PEER_LOST, f"{lost}; restart every worker with the same command: the run resumes from the last backup"


def main(argv=None):
    phases = PhaseClock(MODULE_STARTED)
    phases.done("imports")
    parser = config.build_parser("train_mnist_mirrored.py", __doc__)
    args = parser.parse_args(argv)
    # From here on SIGTERM saves and stops training at the next step boundary, or ends the run at once when
    # it is not training (exit 143 either way).
    with sigterm.watched() as preemption, phases.running():
        status, problem = outcome(args, preemption, phases)
    if problem:
        terminal.stopped(status, problem)
    if worker_group.started():
        worker_group.leave(status)
    run_lock.release()
    return status


if __name__ == "__main__":
    # Everything is on disk by now; the interpreter's teardown of TensorFlow would add a second or more to each run.
    sigterm.end_process(main())
