"""Every option and choice of `--help` runs to the end somewhere in the suite, alone or as a user would combine
them; these are the runs of those no other test runs to the end. Each is a real process on the tests' tiny data.
The multi-worker choices run in test_cluster_start.py's two workers (a ring, bfloat16, validating) and
test_schedulers.py's two Slurm tasks (`--communication auto`, float16 under mixed precision)."""

import json
import os

import pytest

from processes import run_entrypoint
from runs import assert_only_documented_outputs, smoke_args

# Each run: its flags beside the smoke run's, and what its results.json must then say.
RUNS = {
    # The default strategy (no distribution) and XLA where it compiles: one device, no collective.
    "default-strategy": (["--strategy", "default", "--jit-compile", "--verbose", "--fused-adam", "--buffer-size", "100"],
                         {"strategy": "default", "replicas": 1, "devices": ["/device:CPU:0"]}),
    # Named devices, the other all-reduce that runs on CPUs, and Keras's own (unfused) Adam.
    "devices": (["--devices", "/cpu:0", "--cross-device-ops", "reduce-to-one", "--no-fused-adam",
                 "--allreduce-dtype", "float32"],
                {"strategy": "mirrored", "replicas": 1, "cross_device_ops": "reduce-to-one"}),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def one_process_run(request, tmp_path_factory, data_dir):
    flags, expected = RUNS[request.param]
    output_dir = str(tmp_path_factory.mktemp(request.param) / "out")
    proc = run_entrypoint([*smoke_args(data_dir, output_dir), *flags], os.path.dirname(output_dir))
    return proc, output_dir, flags, expected


@pytest.mark.slow
def test_runs_to_the_end_and_records_its_choices(one_process_run):
    proc, output_dir, flags, expected = one_process_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # --verbose shows what is held back otherwise: TensorFlow's start-up notices (docs/terminal.md).
    assert ("All log messages before absl::InitializeLog()" in proc.stderr) == ("--verbose" in flags)
    with open(os.path.join(output_dir, "results.json")) as f:
        results = json.load(f)
    assert {key: results[key] for key in expected} == expected
    assert results["eval_accuracy_checkpoint"] == results["eval_accuracy_unreplicated"] > 0.5
    assert_only_documented_outputs(output_dir)

