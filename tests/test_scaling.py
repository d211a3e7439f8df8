"""The scaling benchmark runs its three configurations end to end on tiny data, and two workers all-reducing in
bfloat16 beside them; its ratios agree with its figures. The all-reduce benchmark runs."""

import json
import os
import subprocess
import sys

import pytest

import netns
from processes import ROOT, run_benchmark, skip_unless_ci, subprocess_env


@pytest.mark.slow
def test_scaling_benchmark_writes_consistent_figures(tmp_path, data_dir):
    out = tmp_path / "scaling.json"
    reason = netns.unavailable()
    if reason:
        skip_unless_ci(reason)
    # The smallest size that runs every line: one round, ten steps of each configuration; in a network namespace
    # of its own, so that the loopback bytes it counts are its workers' alone.
    proc = run_benchmark("scaling.py", "--data-dir", data_dir, "--quick", "--rounds", "1", "--steps-per-epoch", "10",
                         "--allreduce-dtype", "bfloat16", "--output", str(out), timeout=900, run_in=netns.OWN_LOOPBACK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 1 and figures["epochs"] == 1 and figures["steps_per_epoch"] == 10  # as given
    batch = figures["batches"]["64"]
    runs, medians = batch["runs"], batch["medians"]
    assert list(runs) == ["1 replica", "1 worker", "2 workers", "2 workers, bfloat16"]
    for name, measured in runs.items():
        (run,) = measured
        assert run["images_per_s"] > 0 and run["images_per_cpu_s"] > 0 and run["load_average"] >= 0
        # Images per CPU-second count every process of the configuration.
        assert abs(run["images_per_cpu_s"] - run["train_images"] / sum(run["cpu_seconds"])) < 1e-6 * run["images_per_cpu_s"]
    # Two workers train twice the global batch, each process pinned to a core of its own where there are two.
    assert [runs[name][0]["global_batch"] for name in runs] == [64, 64, 128, 128]
    assert len(runs["2 workers"][0]["cpu_seconds"]) == 2
    # What went over loopback, measured: gradients in bfloat16 are half the bytes of float32's.
    sent = {name: runs[name][0]["loopback_bytes_per_step"] for name in ("2 workers", "2 workers, bfloat16")}
    assert 0 < sent["2 workers, bfloat16"] < sent["2 workers"], sent
    two16 = medians["2 workers, bfloat16"]
    assert abs(batch["efficiency, 2 workers, bfloat16"] - two16["images_per_s"] / (2 * medians["1 replica"]["images_per_s"])) < 1e-9
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(set(runs["2 workers"][0]["cores"])) == 2
    single = medians["1 replica"]
    assert abs(batch["efficiency"] - medians["2 workers"]["images_per_s"] / (2 * single["images_per_s"])) < 1e-9
    assert abs(batch["one_worker_ratio"] - medians["1 worker"]["images_per_s"] / single["images_per_s"]) < 1e-9
    assert abs(batch["cpu_efficiency"] - medians["2 workers"]["images_per_cpu_s"] / single["images_per_cpu_s"]) < 1e-9
    # The printed table carries the same headline.
    assert f"2-worker efficiency: {batch['efficiency']:.2f} (CPU {batch['cpu_efficiency']:.2f})" in proc.stdout


@pytest.mark.slow
def test_allreduce_benchmark_prints_each_case():
    proc = run_benchmark("allreduce.py", "--repeats", "3", "--rounds", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[:20].strip(): line[20:].split() for line in proc.stdout.splitlines()
            if line.startswith(("gradients", "4 bytes"))}
    assert set(rows) == {"gradients, float32", "gradients, bfloat16", "4 bytes, float32"}
    # One gradient for each parameter of the model model.py builds.
    import data
    import model

    parameters = model.build_model(*data.image_shape_and_classes()).count_params()
    assert rows["gradients, float32"][0] == f"{4 * parameters:,}" and rows["gradients, bfloat16"][0] == f"{2 * parameters:,}"
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows.values())


@pytest.mark.slow
def test_scaling_benchmark_refuses_a_bad_batch_list(tmp_path, data_dir):
    proc = run_benchmark("scaling.py", "--data-dir", data_dir, "--batches", "64,lots", "--output",
                         str(tmp_path / "s.json"), timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "--batches" in proc.stderr
    assert not (tmp_path / "s.json").exists()


def test_gpu_check_is_ready_to_run(tmp_path):
    """The GPU check's command lines, without a GPU: its dry run lists the five runs, and a real run refuses."""
    env = {**subprocess_env(), "PATH": "/usr/bin:/bin"}  # no nvidia-smi: the machine has no GPU
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    dry = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--data-dir", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    runs = [line for line in dry.stdout.splitlines() if line.startswith("[")]
    assert [run.split("]")[0][1:] for run in runs] == [
        "1 GPU", "1 GPU, --mixed-precision", "1 GPU, --mixed-precision bfloat16", "2 logical GPUs on one, nccl",
        "2 logical GPUs on one, hierarchical-copy"]
    assert all(f"--data-dir {tmp_path} " in run for run in runs)
    assert runs[1].endswith("--mixed-precision") and runs[2].endswith("--mixed-precision bfloat16")
    assert "--cross-device-ops nccl" in runs[3]
    real = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--data-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert real.returncode == 2 and real.stderr.strip().startswith("error:") and "no GPU" in real.stderr
