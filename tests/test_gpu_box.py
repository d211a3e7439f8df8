"""A machine with NVIDIA GPUs that TensorFlow cannot use: the run stops with one line unless it asked for the CPU.
A stand-in `nvidia-smi` on PATH lists two GPUs; this machine's TensorFlow sees none."""

import os

import pytest
import tensorflow as tf

from machinery import gpu_box
from config import Config
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED, UsageError
from processes import EXIT_SECONDS, Worker, finish, run_entrypoint
from runs import smoke_args

TWO_GPUS = """#!/bin/sh
echo "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0b8f8a3e-8c57-4a4e-9a5c-4c0e1f0d1a01)"
echo "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-0b8f8a3e-8c57-4a4e-9a5c-4c0e1f0d1a02)"
"""
# What nvidia-smi says where the driver is installed but not loaded, with its exit status.
FAILING = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
exit 9
"""
HANGING = "#!/bin/sh\nexec sleep 60\n"


def stand_in(directory, script):
    """A folder holding `script` as nvidia-smi, to put first on PATH."""
    directory.mkdir()
    path = directory / "nvidia-smi"
    path.write_text(script)
    path.chmod(0o755)
    return str(directory)


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """PATH, in this process and the runs it starts, finds a stand-in nvidia-smi listing two GPUs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([stand_in(tmp_path / "bin", TWO_GPUS), os.environ["PATH"]]))


@pytest.mark.slow
def test_gpu_box_without_cuda_libraries_stops_before_writing_anything(two_gpus, tmp_path, data_dir):
    out = tmp_path / "out"
    run = run_entrypoint(smoke_args(data_dir, str(out)), tmp_path, timeout=300)
    assert run.returncode == EXIT_BAD_INPUT, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "Number of devices" not in run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this machine has 2 NVIDIA GPUs but TensorFlow"), run.stderr
    assert f"pip install 'tensorflow[and-cuda]=={tf.__version__}'" in lines[0] and "--allow-cpu" in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_allow_cpu_starts_on_the_cpu_of_a_gpu_box(two_gpus, tmp_path, data_dir):
    """Past the check, to its strategy on the CPU; then pre-empted, as the rest of the run is every other test's."""
    run = Worker(smoke_args(data_dir, str(tmp_path / "out")) + ["--allow-cpu"], {}, tmp_path, "allowed")
    try:
        run.wait_for("Number of devices: 1")
        run.proc.terminate()
        finish([run], EXIT_SECONDS)
    finally:
        run.proc.kill()
    assert run.returncode in (EXIT_PREEMPTED, EXIT_OK), run.stderr[-3000:]
    assert "NVIDIA GPUs" not in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("options, environ", [
    ({"allow_cpu": True}, {}),
    ({"cpu_replicas": 2}, {}),
    ({"devices": "/cpu:0"}, {}),
    ({}, {"CUDA_VISIBLE_DEVICES": ""}),
    ({}, {"CUDA_VISIBLE_DEVICES": "-1"}),
], ids=["allow-cpu", "cpu-replicas", "cpu-devices", "gpus-hidden", "gpus-hidden-1"])
def test_a_run_that_asked_for_the_cpu_goes_on(two_gpus, options, environ):
    gpu_box.refuse_silent_cpu_run(Config(**options), tf, environ)


@pytest.mark.parametrize("options, environ, cause", [
    ({}, {}, "CUDA 12 libraries are missing"),
    ({"devices": "/gpu:0,/gpu:1"}, {}, "CUDA 12 libraries are missing"),
    ({}, {"CUDA_VISIBLE_DEVICES": "3"}, "CUDA_VISIBLE_DEVICES=3"),
], ids=["default", "gpu-devices", "other-gpu-visible"])
def test_a_run_that_did_not_ask_for_the_cpu_is_refused(two_gpus, options, environ, cause):
    with pytest.raises(UsageError, match="2 NVIDIA GPUs") as refusal:
        gpu_box.refuse_silent_cpu_run(Config(**options), tf, environ)
    assert cause in str(refusal.value)


@pytest.mark.parametrize("script, listed", [(None, None), (FAILING, 0), (HANGING, 0)],
                         ids=["missing", "failing", "hanging"])
def test_an_absent_failing_or_hung_nvidia_smi_never_stops_a_cpu_run(script, listed, tmp_path, monkeypatch):
    folder = stand_in(tmp_path / "bin", script) if script else str(tmp_path)
    monkeypatch.setenv("PATH", folder)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_box.listed_by_nvidia_smi(timeout=1) == listed
    if script != HANGING:  # the default timeout would only make this test slower
        gpu_box.refuse_silent_cpu_run(Config(), tf)


def test_the_driver_s_list_counts_only_where_its_devices_are_reachable(tmp_path):
    gpus = tmp_path / "gpus"
    for address in ("0000:07:00.0", "0000:0a:00.0"):
        (gpus / address).mkdir(parents=True)
    control = tmp_path / "nvidiactl"
    assert gpu_box.listed_by_driver(str(gpus), str(control)) == 0  # a container given no GPU sees the host's list
    control.write_text("")
    assert gpu_box.listed_by_driver(str(gpus), str(control)) == 2
    assert gpu_box.listed_by_driver(str(tmp_path / "none"), str(control)) == 0


@pytest.mark.slow
def test_gpu_check_stops_before_its_runs(two_gpus, tmp_path, data_dir):
    """benchmarks/gpu_check.sh, on the same machine: the entrypoint's line, before it prepares or runs anything."""
    import subprocess

    from processes import ROOT

    out = tmp_path / "check"
    check = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--data-dir", data_dir, "--output-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == EXIT_BAD_INPUT, check.stderr[-3000:]
    lines = check.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this machine has 2 NVIDIA GPUs"), check.stderr
    assert "running" not in check.stdout and not out.exists()
