"""A machine with NVIDIA GPUs trains on them, or says why not: never a silent run on its CPU.

`pip install tensorflow` alone finds no GPU: TensorFlow 2.21 needs the CUDA 12 libraries of its `and-cuda` extra
(or a system CUDA 12.5 with cuDNN 9.3). Without them it logs only "Could not find cuda drivers on your machine,
GPU will not be used." (libcudart missing, not the driver), which terminal.py holds back, and trains on the CPU.
So before the strategy is made, a run that did not ask for the CPU stops on such a machine (docs/multi-gpu.md,
"A GPU box").

    python -m machinery.gpu_box   # exit 2 with the same one line where the run would stop; for benchmarks/gpu_check.sh
"""

import os
import subprocess
import sys

from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, UsageError

# The driver's own list of its GPUs, one folder each (PCI address), where nvidia-smi is not installed.
DRIVER_GPUS = "/proc/driver/nvidia/gpus"
# Present only where this process may reach the GPUs: a container given none still sees the host's
# DRIVER_GPUS, but not its device files.
DRIVER_CONTROL = "/dev/nvidiactl"
# nvidia-smi -L answers in well under a second; a hung driver can keep it for minutes, and a CPU run must not wait.
NVIDIA_SMI_SECONDS = 5


def listed_by_nvidia_smi(timeout=NVIDIA_SMI_SECONDS):
    """How many GPUs `nvidia-smi -L` lists ("GPU 0: ... (UUID: GPU-...)" lines); None where it is not installed.
    0 when it fails or hangs: no GPU this process could use."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout, check=True)
    except FileNotFoundError:
        return None
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


def listed_by_driver(folder=DRIVER_GPUS, control=DRIVER_CONTROL):
    """How many GPUs the NVIDIA driver lists, where this process can reach them (0 otherwise)."""
    try:
        return len(os.listdir(folder)) if os.path.exists(control) else 0
    except OSError:
        return 0


def nvidia_gpus():
    """NVIDIA GPUs on this machine, whatever TensorFlow sees: nvidia-smi's count, or the driver's without it."""
    listed = listed_by_nvidia_smi()
    return listed_by_driver() if listed is None else listed


def cpu_asked_for(cfg, tf, environ):
    """True when the run was told to use the CPU: --allow-cpu, --cpu-replicas, --devices naming CPUs only, or
    every GPU hidden (CUDA_VISIBLE_DEVICES empty or -1). `cfg` None is the default command, which says none of it."""
    hidden = environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    if cfg is None:
        return hidden
    cpus_only = bool(cfg.device_list) and all(tf.DeviceSpec.from_string(d).device_type == "CPU"
                                               for d in cfg.device_list)
    return cfg.allow_cpu or bool(cfg.cpu_replicas) or cpus_only or hidden


def why_no_gpu(count, tf, environ):
    """The one line for a machine whose `count` NVIDIA GPUs TensorFlow cannot use: cause, then fix."""
    gpus = f"{count} NVIDIA GPU{'s' * (count != 1)}"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        cause = f"CUDA_VISIBLE_DEVICES={visible} names none of them, or its CUDA 12 libraries are missing"
    elif not tf.test.is_built_with_cuda():
        cause = "this TensorFlow is built without CUDA (tensorflow-cpu?)"
    else:
        cause = ("most likely its CUDA 12 libraries are missing (the plain tensorflow wheel, or a system with "
                 "CUDA 13 only)")
    return (f"this machine has {gpus} but TensorFlow {tf.__version__} sees none: {cause}; install TensorFlow "
            f"with its CUDA 12 libraries: pip install 'tensorflow[and-cuda]=={tf.__version__}' (README, Quick "
            f"start), or pass --allow-cpu to train on the CPU anyway")


def refuse_silent_cpu_run(cfg, tf, environ=os.environ):
    """Raises UsageError where NVIDIA GPUs are present, TensorFlow sees none and the run did not ask for the CPU.
    The probe runs only then, so a run on GPUs or on a CPU-only machine pays nothing but TensorFlow's own look."""
    if cpu_asked_for(cfg, tf, environ) or tf.config.list_physical_devices("GPU"):
        return
    count = nvidia_gpus()
    if count:
        raise UsageError(why_no_gpu(count, tf, environ))


def main():
    """The check alone, for benchmarks/gpu_check.sh: exit 0 where TensorFlow can use the GPUs (or there are
    none), 2 with the run's own line where it cannot."""
    from machinery import terminal

    tf = terminal.start_tensorflow(verbose=False)
    try:
        refuse_silent_cpu_run(None, tf)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)
    print(f"TensorFlow sees {len(tf.config.list_physical_devices('GPU'))} GPU(s); nvidia-smi lists {nvidia_gpus()}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
