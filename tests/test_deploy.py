"""deploy/: the Slurm batch script and the Kubeflow TFJob manifest run commands the entrypoint accepts.

Real Slurm runs the batch script in tests/test_slurm.py; here, without any daemon, a stand-in `srun` records
the command the script gives it.
"""

import os
import subprocess

import yaml

import config
from conftest import ROOT

SBATCH = os.path.join(ROOT, "deploy", "slurm.sbatch")
TFJOB = os.path.join(ROOT, "deploy", "tfjob.yaml")
ENTRYPOINT = ["python", "train_mnist_mirrored.py"]


def parsed(command):
    """The entrypoint's own parser on `command`'s options; argparse exits 2 on any it does not accept."""
    assert command[:2] == ENTRYPOINT, command
    return config.from_args(config.build_parser("train_mnist_mirrored.py", "").parse_args(command[2:]))


def test_tfjob_runs_the_entrypoint_with_options_it_accepts_in_every_pod():
    with open(TFJOB) as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "TFJob"
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker"}
    for spec in specs.values():
        # Kubeflow restarts a pod on 130, 137, 138 and 143 only with this policy (docs/clusters.md).
        assert spec["restartPolicy"] == "ExitCode"
        container, = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        cfg = parsed(container["command"] + container.get("args", []))
        assert cfg.strategy == "multiworker"
        # The data and the outputs are on the volume every pod mounts.
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        for path in (cfg.data_dir, cfg.idx_dir, cfg.output_dir):
            assert any(path.startswith(m + "/") for m in mounts), path


def test_sbatch_script_gives_srun_the_entrypoint_and_its_own_arguments_last(tmp_path):
    """`sbatch deploy/slurm.sbatch --epochs 1 --output-dir DIR`: the arguments reach every task and win."""
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "srun-argv"
    (fake / "srun").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {record}\n')
    (fake / "srun").chmod(0o755)
    output_dir = str(tmp_path / "my runs" / "try")  # a space, which the script must keep in one argument
    proc = subprocess.run(["bash", SBATCH, "--epochs", "1", "--output-dir", output_dir], cwd=ROOT,
                          env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "HOME": "/home/u"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = record.read_text().split("\0")[:-1]
    # srun ends the step when a task fails; each task runs the entrypoint under a shell that records its status.
    assert argv[0] == "--kill-on-bad-exit=1" and argv[1:3] == ["bash", "-c"]
    cfg = parsed(argv[argv.index("task") + 1:])
    assert cfg.strategy == "multiworker" and cfg.epochs == 1 and cfg.output_dir == output_dir
    # The script's own defaults stay where the caller did not override them.
    assert cfg.data_dir == "/home/u/tensorflow_datasets" and cfg.idx_dir == "/home/u/mnist-idx"
