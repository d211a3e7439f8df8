"""The entrypoint's one-line refusals, run in-process (in a process of its
own where the test must hide the GPUs)."""

import json
import os
import shutil
import types

import pytest

import config
import data
import train_mnist_mirrored
from machinery import tfds_builders
from machinery.exits import EXIT_BAD_INPUT, UsageError
from processes import run_entrypoint
from runs import smoke_args

# These tests read the entrypoint's stderr in this process.
pytestmark = pytest.mark.usefixtures("gpus_probed")

CLOSED_PORT = ("127.0.0.1", 9)  # discard port; nothing listens there on a test machine

# `data` imported TensorFlow above, before any run could hold back its start-up lines; TensorFlow's first GPU probe,
# which an in-process run would then make, prints CUDA's cuInit failure into that test's stderr. Probed once here,
# as an earlier module does when the whole suite runs; fresh processes (run_entrypoint) show no such line.
data.tf.config.list_physical_devices()


def _one_error_line(capsys):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), err
    return lines[0]


# ---------------------------------------------------------------- bad flags

@pytest.fixture
def quick_args(tmp_path):
    def make(*extra, output_dir=None):
        return ["--epochs", "1", "--steps-per-epoch", "3", "--batch-size-per-replica", "16",
                "--data-dir", str(tmp_path / "unused-data"), "--output-dir", output_dir or str(tmp_path / "out"),
                *extra]
    return make


@pytest.mark.parametrize("flags, words", [
    (["--epochs", "0"], ["--epochs"]),
    (["--epochs", "-1"], ["--epochs"]),
    (["--batch-size-per-replica", "0"], ["--batch-size-per-replica"]),
    (["--cpu-replicas", "-1"], ["--cpu-replicas"]),
    (["--cpu-replicas", "999"], ["--cpu-replicas", "999"]),
    (["--backup-every-steps", "0"], ["--backup-every-steps"]),
    # A backup falls between two calls of steps_per_execution steps; the fix names the nearest multiple.
    (["--backup-every-steps", "120", "--steps-per-execution", "50"], ["--backup-every-steps", "multiple", "100"]),
], ids=["epochs0", "epochs-1", "batch0", "cpu-replicas-1", "cpu-replicas999", "backup-steps0", "backup-steps-not-multiple"])
def test_bad_numbers_are_refused(flags, words, quick_args, tmp_path, capsys):
    rc = train_mnist_mirrored.main(quick_args(*flags))
    line = _one_error_line(capsys)
    assert rc != 0
    for word in words:
        assert word in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("flags, words", [
    (["--warmup-epochs", "2"], ["--warmup-epochs", "--scale-lr"]),
    (["--warmup-epochs", "-1", "--scale-lr"], ["--warmup-epochs", "-1"]),
    (["--cross-device-ops", "reduce-to-one", "--strategy", "default"], ["--cross-device-ops", "mirrored"]),
    (["--communication", "ring"], ["--communication", "multiworker", "--cross-device-ops"]),
    (["--cross-device-ops", "nccl", "--cpu-replicas", "2"], ["nccl", "--cpu-replicas", "reduce-to-one"]),
    (["--allreduce-dtype", "bfloat16"], ["--allreduce-dtype bfloat16", "multiworker"]),
    (["--allreduce-dtype", "float16", "--strategy", "multiworker", "--no-fused-adam",
      "--cluster-timeout", "1"], ["--allreduce-dtype float16", "--no-fused-adam"]),
    (["--devices", "/cpu:0", "--strategy", "default"], ["--devices", "mirrored"]),
    # XLA reaches no variable on another logical CPU: the compiled step would fail at its first call.
    (["--jit-compile", "--cpu-replicas", "2"], ["--jit-compile", "--cpu-replicas 2", "drop --jit-compile"]),
], ids=["warmup-without-scale", "warmup-1", "cross-device-ops-not-mirrored", "communication-not-multiworker",
        "nccl-on-cpu-replicas", "allreduce-dtype-not-multiworker", "allreduce-dtype-without-fused-adam",
        "devices-not-mirrored", "jit-compile-on-cpu-replicas"])
def test_option_combinations_are_refused(flags, words, quick_args, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    rc = train_mnist_mirrored.main(quick_args(*flags))
    line = _one_error_line(capsys)
    assert rc == EXIT_BAD_INPUT
    for word in words:
        assert word in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("devices", ["cpu0", "/xpu:0", "0,1", "/gpu:0/gpu:1", "/cpu:*"])
def test_malformed_devices_are_refused_before_tensorflow_starts(devices, quick_args, tmp_path, capsys):
    rc = train_mnist_mirrored.main(quick_args("--devices", devices))
    line = _one_error_line(capsys)
    assert rc == EXIT_BAD_INPUT
    assert f"--devices names {devices.split(',')[0]}" in line and "/gpu:0,/gpu:1" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, words", [
    (["--cross-device-ops", "nccl"], ["--cross-device-ops nccl", "GPU", "reduce-to-one"]),
    (["--strategy", "multiworker", "--communication", "nccl"], ["--communication nccl", "GPU", "ring"]),
    # XLA compiles no all-reduce between CPU workers (docs/upstream/xla_cpu_collectives.py); between GPUs it does.
    (["--strategy", "multiworker", "--jit-compile"], ["--jit-compile", "no GPU", "drop --jit-compile"]),
], ids=["mirrored", "multiworker", "jit-compile-multiworker"])
@pytest.mark.slow
def test_gpu_only_options_without_gpus_are_refused(flags, words, quick_args, tmp_path):
    """Checked where TensorFlow knows the devices, before the strategy exists and before any output.

    A real process with every GPU hidden, so the machine has none whether or not the test host has some.
    """
    env = {"CUDA_VISIBLE_DEVICES": "",
           "TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:12345"]}, "task": {"type": "worker", "index": 0}})}
    proc = run_entrypoint(quick_args(*flags), tmp_path, env, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0]
    assert not (tmp_path / "out").exists()


def test_output_dir_that_is_a_file_is_refused_and_untouched(quick_args, tmp_path, capsys):
    target = tmp_path / "a_file"
    content = b"precious bytes\n"
    target.write_bytes(content)
    rc = train_mnist_mirrored.main(quick_args(output_dir=str(target)))
    line = _one_error_line(capsys)
    assert rc != 0
    assert "--output-dir" in line
    assert target.read_bytes() == content


def test_output_dir_below_a_file_is_refused(quick_args, tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_bytes(b"x")
    rc = train_mnist_mirrored.main(quick_args(output_dir=str(target / "sub")))
    line = _one_error_line(capsys)
    assert rc != 0
    assert "--output-dir" in line
    assert target.read_bytes() == b"x"


def test_empty_output_dir_is_refused(tmp_path, monkeypatch, capsys):
    """--output-dir "" (an unset shell variable) is refused up front instead of crashing later."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    rc = train_mnist_mirrored.main(["--epochs", "1", "--output-dir", ""])
    assert rc != 0
    assert "--output-dir" in _one_error_line(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tf_config, words", [
    (None, ["TF_CONFIG", "srun"]),
    ("{not json", ["TF_CONFIG", "JSON"]),
    (json.dumps({"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
                 "task": {"type": "worker", "index": 5}}), ["index", "5"]),
    (json.dumps({"cluster": {"worker": ["localhost:grpc"]}, "task": {"type": "worker", "index": 0}}), ["host:port"]),
], ids=["unset", "not-json", "bad-index", "port-not-a-number"])
def test_multiworker_needs_a_valid_tf_config(tf_config, words, quick_args, tmp_path, monkeypatch, capsys):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    rc = train_mnist_mirrored.main(quick_args("--strategy", "multiworker"))
    line = _one_error_line(capsys)
    assert rc != 0
    for word in words:
        assert word in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- no prepared data, offline

def test_a_dataset_name_neither_tfds_nor_prepared_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    empty = tmp_path / "empty_tfds"
    empty.mkdir()
    rc = train_mnist_mirrored.main(["--dataset", "no_such_dataset", *smoke_args(str(empty), str(tmp_path / "out"))])
    line = _one_error_line(capsys)
    assert rc == EXIT_BAD_INPUT
    assert "--dataset no_such_dataset is no tfds dataset" in line and str(empty) in line
    assert not (tmp_path / "out").exists()


def test_a_dataset_of_another_kind_is_not_prepared_from_idx_files(idx_dir, tmp_path, capsys):
    """IDX files hold MNIST's grayscale images: cifar10's 32x32x3 are not made from them, and tfds's own prepare
    is named instead."""
    import prepare_mnist

    rc = prepare_mnist.main(["--idx-dir", idx_dir, "--data-dir", str(tmp_path / "data"), "--dataset", "cifar10"])
    line = _one_error_line(capsys)
    assert rc == EXIT_BAD_INPUT and "32x32x3" in line and "tfds build cifar10" in line
    assert not (tmp_path / "data").exists()


def test_missing_prepared_data_points_at_prepare_mnist(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tfds_builders, "DOWNLOAD_HOST", CLOSED_PORT)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    empty = tmp_path / "empty_tfds"
    empty.mkdir()
    rc = train_mnist_mirrored.main(smoke_args(str(empty), str(tmp_path / "out")))
    line = _one_error_line(capsys)
    assert rc != 0
    assert "prepare_mnist.py --idx-dir" in line
    assert str(empty) in line
    assert os.listdir(empty) == []  # nothing half-downloaded
    assert not (tmp_path / "out").exists()  # the data is read before any output is touched


def test_nonexistent_data_dir_points_at_prepare_mnist(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tfds_builders, "DOWNLOAD_HOST", CLOSED_PORT)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    missing = tmp_path / "no_such_dir"
    rc = train_mnist_mirrored.main(smoke_args(str(missing), str(tmp_path / "out")))
    line = _one_error_line(capsys)
    assert rc != 0
    assert "prepare_mnist.py --idx-dir" in line
    assert not missing.exists()


# ---------------------------------------------------------------- a finished run is not overwritten

@pytest.mark.slow
def test_rerun_into_finished_output_dir_refuses_without_overwrite(smoke_ok, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    copy = tmp_path / "finished"
    shutil.copytree(smoke_ok.output_dir, copy)
    before = {p: (copy / p).read_bytes() for p in ("results.json",)}
    checkpoints_before = sorted(os.listdir(copy / "training_checkpoints"))

    rc = train_mnist_mirrored.main(smoke_args(data_dir, str(copy)))

    line = _one_error_line(capsys)
    assert rc != 0
    assert "--overwrite" in line
    assert (copy / "results.json").read_bytes() == before["results.json"]
    assert sorted(os.listdir(copy / "training_checkpoints")) == checkpoints_before
    assert (copy / "saved_model" / "saved_model.pb").is_file()


@pytest.mark.parametrize("devices, words", [
    # MirroredStrategy itself would accept /gpu:7 on a CPU-only machine and train elsewhere.
    ("/gpu:7", ["/gpu:7", "cpu:0"]),
    # Two spellings of one device: MirroredStrategy's own check is an AssertionError.
    ("/cpu:0,CPU:0", ["/cpu:0,CPU:0", "more than once"]),
], ids=["lacking", "twice"])
def test_devices_this_machine_lacks_or_named_twice_are_refused(devices, words, data_dir, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    output_dir = tmp_path / "out"
    rc = train_mnist_mirrored.main(["--epochs", "1", "--steps-per-epoch", "3", "--data-dir", data_dir,
                                    "--output-dir", str(output_dir), "--devices", devices])
    assert rc == EXIT_BAD_INPUT
    line = _one_error_line(capsys)
    for word in words:
        assert word in line, line
    assert not output_dir.exists()


# ---------------------------------------------------------------- --jit-compile where XLA compiles the all-reduce

class _Machine:
    """What the strategy's checks ask TensorFlow about the machine, for GPUs this test machine lacks."""

    def __init__(self, gpus):
        self.config = types.SimpleNamespace(list_physical_devices=lambda kind=None: ["GPU"] * gpus if kind == "GPU" else [])


def test_jit_compile_is_refused_only_where_the_all_reduce_is_between_cpus():
    multiworker = config.Config(strategy="multiworker", jit_compile=True)
    with pytest.raises(UsageError, match="--jit-compile"):
        train_mnist_mirrored.refuse_xla_collectives_on_cpus(multiworker, _Machine(gpus=0))
    # Workers of GPUs all-reduce between GPUs, which XLA compiles; so do two GPUs of one machine.
    train_mnist_mirrored.refuse_xla_collectives_on_cpus(multiworker, _Machine(gpus=2))
    config.validate(config.Config(jit_compile=True, devices="/gpu:0,/gpu:1"))
    config.validate(config.Config(jit_compile=True, cpu_replicas=1))
