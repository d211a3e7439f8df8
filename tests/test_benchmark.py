"""The throughput benchmark runs end to end on tiny data and writes figures that agree with each other."""

import json
import statistics
import subprocess
import sys

from conftest import ROOT, subprocess_env


def _bench(*args):
    return subprocess.run([sys.executable, "benchmarks/throughput.py", *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)


def test_benchmark_writes_sane_figures(tmp_path, idx_dir):
    out = tmp_path / "bench.json"
    proc = _bench("--idx-dir", idx_dir, "--rounds", "2", "--epochs", "1", "--variants", "project,keras_adam",
                  "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["images_per_s"]) == {"tutorial", "project", "keras_adam"}
    for rates in figures["images_per_s"].values():
        assert len(rates) == 2 and all(rate > 0 for rate in rates)
    medians = {name: statistics.median(rates) for name, rates in figures["images_per_s"].items()}
    for name, ratio in figures["ratio_to_tutorial"].items():
        assert abs(ratio - medians[name] / medians["tutorial"]) < 0.01 * ratio + 1e-3
    assert figures["ratio_to_tutorial"]["tutorial"] == 1.0
    assert figures["compute_ceiling_images_per_s"] > 0
    # The printed table carries the same ratio.
    assert f"{figures['ratio_to_tutorial']['project']:.2f}" in proc.stdout


def test_benchmark_rejects_an_unknown_variant(tmp_path, data_dir):
    proc = _bench("--data-dir", data_dir, "--variants", "warp_drive", "--output", str(tmp_path / "b.json"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "warp_drive" in proc.stderr
    assert not (tmp_path / "b.json").exists()
