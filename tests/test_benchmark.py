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
    proc = _bench("--idx-dir", idx_dir, "--quick", "--epochs", "1", "--variants", "project,autotune",
                  "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    names = {"tutorial", "project", "autotune", "ceiling"}
    assert figures["rounds"] == 2 and figures["epochs_per_round"] == 1  # --quick's rounds, --epochs given after it
    for rates_key, prefix in (("images_per_s", ""), ("images_per_cpu_s", "cpu_")):
        assert set(figures[rates_key]) == names
        for rates in figures[rates_key].values():
            assert len(rates) == 2 and all(rate > 0 for rate in rates)
        medians = {name: statistics.median(rates) for name, rates in figures[rates_key].items()}
        for baseline in ("ceiling", "tutorial"):
            ratios = figures[f"{prefix}ratio_to_{baseline}"]
            assert set(ratios) == names and ratios[baseline] == 1.0
            for name, ratio in ratios.items():
                assert abs(ratio - medians[name] / medians[baseline]) < 0.01 * ratio + 1e-3
    # The project reads its resident split before fit, and says how long that took; the tutorial reads lazily.
    assert all(seconds > 0 for seconds in figures["read_seconds"]["project"])
    assert figures["read_seconds"]["tutorial"] == [0.0, 0.0]
    # Steal is a share of the machine's CPU time (this test runs on Linux, where /proc/stat gives it).
    for shares in figures["steal_percent"].values():
        assert len(shares) == 2 and all(0 <= share <= 100 for share in shares)
    assert figures["cpu_cores"] >= 1 and figures["cpu_model"]
    # The printed headline carries the same ratio.
    assert f"project: {figures['ratio_to_ceiling']['project']:.3f} of the compute ceiling" in proc.stdout


def test_benchmark_rejects_an_unknown_variant(tmp_path, data_dir):
    proc = _bench("--data-dir", data_dir, "--variants", "warp_drive", "--output", str(tmp_path / "b.json"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "warp_drive" in proc.stderr
    assert not (tmp_path / "b.json").exists()
