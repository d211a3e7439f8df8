"""Every default of the project, in one frozen dataclass, and the command line built from it.

The fields whose metadata carries a `help` text become command-line options of the same name
(`batch_size_per_replica` -> `--batch-size-per-replica`); the others are the tutorial's fixed names.
This module imports nothing heavy, so a bad flag is reported before TensorFlow starts.
"""

import argparse
import dataclasses
import os
import re
import tempfile
import typing

from machinery.exits import UsageError
from machinery.worker_sources import check_port

STRATEGIES = ("mirrored", "multiworker", "default")
# MirroredStrategy's all-reduce (tf.distribute.NcclAllReduce, HierarchicalCopyAllReduce, ReductionToOneDevice).
CROSS_DEVICE_OPS = ("nccl", "hierarchical-copy", "reduce-to-one")
# MultiWorkerMirroredStrategy's collectives (tf.distribute.experimental.CommunicationImplementation).
COMMUNICATIONS = ("auto", "ring", "nccl")
# The type the gradients travel in through the multi-worker all-reduce (model.all_reduce_in); float32 is theirs.
ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")
# The compute types of Keras's mixed-precision policies (mixed_float16, mixed_bfloat16); unset is float32's policy.
MIXED_PRECISIONS = ("float16", "bfloat16")


def _option(default, help_text, group, **extra):
    return dataclasses.field(default=default, metadata={"help": help_text, "group": group, **extra})


# The sections of --help, in this order (argparse argument groups).
TRAINING = "training (the tutorial's settings)"
DATA = "data"
CLUSTER = "distribution and cluster"
MULTI_GPU = "multi-GPU (docs/multi-gpu.md)"
FAULTS = "faults and resume"
SPEED = "speed (each default is the fastest measured)"
OUTPUT = "output"


@dataclasses.dataclass(frozen=True)
class Config:
    epochs: int = _option(12, "number of epochs to train", TRAINING)
    batch_size_per_replica: int = _option(64, "batch size on each replica; the global batch is this times the replica count", TRAINING)
    steps_per_epoch: typing.Optional[int] = _option(None, "train at most this many steps each epoch, for quick smoke runs (unset: the whole epoch)", TRAINING)

    # The one place the dataset is named: any tfds image classification dataset with `image` and `label` features.
    dataset: str = _option("mnist", "tfds name of the dataset: its images' shape, its classes and its splits come "
                                     "from its DatasetInfo (fashion_mnist, cifar10, or one prepared in --data-dir)", DATA)
    data_dir: typing.Optional[str] = _option(None, "tfds data dir; unset means tfds's own, ~/tensorflow_datasets", DATA)
    idx_dir: typing.Optional[str] = _option(None, "offline: if --data-dir holds no prepared --dataset, prepare it first from the four MNIST-format IDX files here (unset: tfds downloads what --data-dir lacks)", DATA)
    buffer_size: int = _option(10000, "shuffle buffer size, in examples", DATA)
    resident_limit_mb: int = _option(
        1024, "cache a split in memory, one copy a worker, while its examples, scaled by data.scale, take at most "
              "this many MB; a larger split streams from tfds's files every epoch (0: always stream)", DATA)

    strategy: str = _option("mirrored", "distribution strategy; multiworker reads the cluster from TF_CONFIG or, "
                                        "without it, from a Kubeflow TrainJob's or Kubernetes Indexed Job's "
                                        "variables, or Slurm's srun's",
                        CLUSTER, choices=STRATEGIES)
    cpu_replicas: int = _option(0, "split the host CPU into N logical devices and mirror across them (0: off)", CLUSTER)
    devices: typing.Optional[str] = _option(None, "comma-separated devices to mirror across, e.g. /gpu:0,/gpu:1; unset means all GPUs", CLUSTER)
    allow_cpu: bool = _option(False, "train on the CPU even where NVIDIA GPUs are present that TensorFlow cannot use; "
                                     "without it such a run stops at once (exit 2) and says how to install "
                                     "TensorFlow's CUDA libraries (docs/multi-gpu.md, \"A GPU box\")", CLUSTER)
    # Schedulers: TF_CONFIG (Kubeflow's TFJob writes it) wins; without it, an Indexed Job's or srun's variables
    # describe the cluster.
    slurm_port_base: typing.Optional[int] = _option(
        None, "under srun without TF_CONFIG: the port of each node's first worker; the node's next workers take the "
              "ports after it (unset: 10000 + 16 x (SLURM_JOB_ID mod 1400), so jobs sharing a node differ)", CLUSTER)
    cluster_timeout: int = _option(
        600, "--strategy multiworker: seconds a worker waits for all the others to start; then it exits 138 naming "
             "those that never came (docs/clusters.md, \"Start-up\")", CLUSTER)

    # The tutorial's learning-rate advice, the all-reduce, precision and memory. Each default keeps the
    # tutorial's behaviour.
    scale_lr: bool = _option(False, "linear scaling rule: multiply every learning rate by global batch / 64 (the tutorial's batch)", MULTI_GPU)
    warmup_epochs: int = _option(0, "with --scale-lr, ramp the learning rate per step from the unscaled to the scaled value over this many epochs", MULTI_GPU)
    cross_device_ops: typing.Optional[str] = _option(None, "MirroredStrategy's all-reduce; unset lets TensorFlow choose (NCCL between GPUs, reduce-to-one otherwise)", MULTI_GPU, choices=CROSS_DEVICE_OPS)
    communication: typing.Optional[str] = _option(None, "MultiWorkerMirroredStrategy's collective implementation; unset means auto", MULTI_GPU, choices=COMMUNICATIONS)
    mixed_precision: typing.Optional[str] = _option(
        None, "Keras's mixed precision, float32 weights either way: float16 (also the bare flag; mixed_float16, with "
              "loss scaling) for GPUs' tensor cores, slow on CPUs; bfloat16 (mixed_bfloat16, no loss scaling) for "
              "CPUs with AVX512_BF16 or AMX and GPUs from Ampere on, slow on other CPUs; unset (or "
              "--no-mixed-precision): float32, the tutorial's (docs/performance.md, \"bfloat16\")",
        MULTI_GPU, choices=MIXED_PRECISIONS, const="float16")
    gpu_memory_growth: bool = _option(False, "let TensorFlow take GPU memory as it needs it instead of nearly all at start (for GPUs shared with other jobs)", MULTI_GPU)

    seed: int = _option(42, "seed for Python, NumPy, TensorFlow and the shuffle", FAULTS)
    backup_every_steps: typing.Optional[int] = _option(
        None, "also back up every N training steps, so a killed run resumes at a step rather than an epoch; "
              "N must be a multiple of --steps-per-execution (unset: at each epoch's end only)", FAULTS)
    deterministic: bool = _option(False, "enable TensorFlow op determinism (bit-identical reruns, slower)", FAULTS)

    steps_per_execution: int = _option(50, "train steps run inside one tf.function call", SPEED)
    fused_adam: bool = _option(True, "Adam through TensorFlow's fused kernel (keras.optimizers.legacy.Adam): same update, fewer ops", SPEED)
    jit_compile: bool = _option(False, "compile the train step with XLA; not where its all-reduce runs between CPU "
                                       "devices (--strategy multiworker on CPUs, --cpu-replicas 2 or more), which XLA "
                                       "cannot compile (docs/multi-gpu.md, \"XLA and the all-reduce\")", SPEED)
    allreduce_dtype: str = _option(
        "float32", "--strategy multiworker: the type the gradients are all-reduced in between workers; bfloat16 or "
                   "float16 halve the bytes sent, and each worker casts the sum back to float32 for Adam's update "
                   "(docs/performance.md, \"Several workers\")", SPEED, choices=ALLREDUCE_DTYPES)

    output_dir: str = _option(".", "where training_checkpoints/, logs/, saved_model/, model.keras and results.json are written", OUTPUT)
    overwrite: bool = _option(False, "start afresh, replacing a finished or unfinished run already in --output-dir", OUTPUT)
    validation: bool = _option(False, "also evaluate on the test split at each epoch's end: val_ figures in the progress "
                                      "bar and a validation run beside train in TensorBoard", OUTPUT)
    verbose: bool = _option(False, "show TensorFlow's C++ start-up notices (oneDNN, CUDA probing), which are held back otherwise", OUTPUT)

    # The tutorial's schedule: 1e-3 for epochs 0-2, 1e-4 for 3-6, 1e-5 after.
    lr_boundaries: tuple = (3, 7)
    lr_values: tuple = (1e-3, 1e-4, 1e-5)

    # Where the tutorial puts its outputs, under output_dir.
    checkpoint_dir: str = "training_checkpoints"
    checkpoint_name: str = "ckpt_{epoch}"
    log_dir: str = "logs"
    saved_model_dir: str = "saved_model"
    keras_model_file: str = "model.keras"  # Keras 3's own format, beside the SavedModel
    backup_dir: str = "backup"
    results_file: str = "results.json"
    lock_file: str = "run.lock"  # held by the run writing here (machinery/run_lock.py)

    def path(self, name):
        return os.path.join(self.output_dir, name)

    @property
    def dtype_policy(self):
        """The name of the Keras policy the model is built under."""
        return f"mixed_{self.mixed_precision}" if self.mixed_precision else "float32"

    @property
    def device_list(self):
        if self.cpu_replicas:
            return [f"/cpu:{i}" for i in range(self.cpu_replicas)]
        if self.devices:
            return [d.strip() for d in self.devices.split(",") if d.strip()]
        return None


# What --devices may name: a CPU or GPU by number, as tf.DeviceSpec reads it, e.g. /gpu:0, GPU:1, /device:CPU:0 or
# /job:localhost/replica:0/task:0/device:GPU:0; checked here, before TensorFlow starts.
DEVICE_NAME = re.compile(r"(/job:\w+)?(/replica:\d+)?(/task:\d+)?/?(device:)?(cpu|gpu):\d+", re.IGNORECASE)


def _positive(name, value):
    if value is not None and value < 1:
        raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def validate(cfg):
    """Checks what can be checked before TensorFlow starts; raises UsageError."""
    for name in ("epochs", "batch_size_per_replica", "buffer_size", "steps_per_epoch", "steps_per_execution",
                 "backup_every_steps", "cluster_timeout"):
        _positive(name, getattr(cfg, name))
    if cfg.backup_every_steps and cfg.backup_every_steps % cfg.steps_per_execution:
        # Keras runs steps_per_execution steps in one call; a backup can only fall between two calls.
        multiple = cfg.steps_per_execution * max(1, round(cfg.backup_every_steps / cfg.steps_per_execution))
        raise UsageError(f"--backup-every-steps {cfg.backup_every_steps} is not a multiple of --steps-per-execution "
                         f"{cfg.steps_per_execution}; use a multiple, e.g. --backup-every-steps {multiple}")
    if cfg.cpu_replicas < 0:
        raise UsageError(f"--cpu-replicas must be 0 (off) or a positive count, got {cfg.cpu_replicas}")
    cores = os.cpu_count() or 1
    if cfg.cpu_replicas > cores:
        raise UsageError(f"--cpu-replicas {cfg.cpu_replicas} is more than this machine's {cores} CPU cores; use at most {cores}")
    if cfg.cpu_replicas and cfg.strategy != "mirrored":
        raise UsageError("--cpu-replicas works with --strategy mirrored only; drop one of them")
    if cfg.cpu_replicas and cfg.devices:
        raise UsageError("--cpu-replicas and --devices both choose the devices; give only one")
    if cfg.devices is not None and not cfg.device_list:
        raise UsageError("--devices is empty; name devices like /gpu:0,/gpu:1 or leave it out")
    if cfg.devices and cfg.strategy != "mirrored":
        raise UsageError("--devices chooses MirroredStrategy's devices, so it works with --strategy mirrored only; "
                         "drop one of them")
    malformed = [d for d in cfg.device_list or [] if not DEVICE_NAME.fullmatch(d)]
    if malformed:
        raise UsageError(f"--devices names {', '.join(malformed)}, which {'is' if len(malformed) == 1 else 'are'} "
                         "not a device; name devices like /gpu:0,/gpu:1 (or /cpu:0), comma-separated")
    if cfg.jit_compile and cfg.cpu_replicas > 1:
        # Each replica's variables live on its own logical CPU, which the compiled step of another cannot reach
        # (XLA's known issue "tf.Variable on a different device").
        raise UsageError(f"--jit-compile cannot compile a step mirrored across --cpu-replicas {cfg.cpu_replicas}: "
                         "XLA reaches no variable on another CPU device; drop --jit-compile, or --cpu-replicas to "
                         "train on one device")
    if cfg.slurm_port_base is not None:
        check_port(cfg.slurm_port_base, f"--slurm-port-base {cfg.slurm_port_base}", "choose the port of each node's "
                   "first worker, or leave it out")
    if cfg.resident_limit_mb < 0:
        raise UsageError(f"--resident-limit-mb must be 0 (always stream) or a size in MB, got {cfg.resident_limit_mb}")
    if cfg.warmup_epochs < 0:
        raise UsageError(f"--warmup-epochs must be 0 (off) or a positive count, got {cfg.warmup_epochs}")
    if cfg.warmup_epochs and not cfg.scale_lr:
        raise UsageError("--warmup-epochs ramps up to the --scale-lr learning rate; add --scale-lr or drop --warmup-epochs")
    if cfg.cross_device_ops and cfg.strategy != "mirrored":
        raise UsageError(f"--cross-device-ops works with --strategy mirrored only; "
                         f"{'use --communication for multiworker' if cfg.strategy == 'multiworker' else 'drop it'}")
    if cfg.communication and cfg.strategy != "multiworker":
        raise UsageError(f"--communication works with --strategy multiworker only; "
                         f"{'use --cross-device-ops for mirrored' if cfg.strategy == 'mirrored' else 'drop it'}")
    if cfg.allreduce_dtype != "float32" and cfg.strategy != "multiworker":
        raise UsageError(f"--allreduce-dtype {cfg.allreduce_dtype} sets the all-reduce between workers, so it works "
                         "with --strategy multiworker only; drop it")
    if cfg.allreduce_dtype != "float32" and not cfg.fused_adam:
        raise UsageError(f"--allreduce-dtype {cfg.allreduce_dtype} works through the fused Adam's gradient "
                         "aggregator; drop --no-fused-adam or --allreduce-dtype")
    if cfg.cross_device_ops == "nccl" and cfg.cpu_replicas:
        raise UsageError("--cross-device-ops nccl all-reduces between GPUs, but --cpu-replicas mirrors CPUs; "
                         "use reduce-to-one or hierarchical-copy with --cpu-replicas")
    _check_output_dir(cfg.output_dir)
    return cfg


def _check_output_dir(path):
    """The nearest existing folder on the way to `path` must be a folder we can really write in."""
    if not path.strip():
        raise UsageError("--output-dir is empty (an unset shell variable?); give a folder, e.g. --output-dir .")
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"--output-dir {path} is not a directory ({probe} is a file); choose a directory path")
    try:
        # os.access says yes to root everywhere; only a real write tells (read-only mounts, /proc).
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as err:
        raise UsageError(f"--output-dir {path} is not writable ({probe}: {err.strerror}); "
                         "choose a directory you can write to") from None


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, except None: "(default: None)" tells nobody anything, so the
    help of every option that can be left unset says what unset means instead (tests/test_first_run.py)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(prog, description):
    parser = argparse.ArgumentParser(prog=prog, description=description, usage="%(prog)s [options]",
                                     formatter_class=_DefaultsHelpFormatter)
    hints = typing.get_type_hints(Config)
    groups = {}
    for field in dataclasses.fields(Config):
        if "help" not in field.metadata:
            continue
        title = field.metadata["group"]
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=field.metadata["help"])
            continue
        base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
        if "const" in field.metadata:
            # A switch that became a choice: the bare flag still means `const`, and its --no- form (which its help
            # names) the default.
            group.add_argument(flag, nargs="?", const=field.metadata["const"], type=base, default=field.default,
                               help=field.metadata["help"], choices=field.metadata.get("choices"))
            group.add_argument("--no-" + flag[2:], dest=field.name, action="store_const", const=field.default,
                               help=argparse.SUPPRESS)
            continue
        group.add_argument(flag, type=base, default=field.default, help=field.metadata["help"],
                            choices=field.metadata.get("choices"))
    return parser


def from_args(args):
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in vars(args).items() if k in names})
