"""The throughput benchmark runs end to end on tiny data and writes figures that agree with each other; its variants
are valid changes of the run's options; the step-cost and phase breakdowns run."""

import json
import os
import statistics
import sys

import pytest

import config
from processes import ROOT, run_benchmark

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # throughput.py's functions, imported where a test uses them


def _bench(*args):
    return run_benchmark("throughput.py", *args, timeout=600)


@pytest.mark.slow
def test_benchmark_writes_sane_figures(tmp_path, idx_dir):
    out = tmp_path / "bench.json"
    # The project beside the baselines: every round is a fresh process; --baseline runs another checkout's default
    # run in the same rounds, here this one's own, and is set against the project as every variant is (each variant
    # is the same run with other options: test_every_variant_is_the_run_with_valid_options). The smallest size that
    # runs every line: one round (the order alternates from the second, in the same line), two epochs (a later
    # epoch's rate).
    proc = _bench("--idx-dir", idx_dir, "--quick", "--epochs", "2", "--rounds", "1", "--variants", "project",
                  "--baseline", ROOT, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    names = {"tutorial", "project", "baseline", "ceiling"}
    assert figures["rounds"] == 1 and figures["epochs_per_round"] == 2  # --rounds and --epochs given after --quick
    for rates_key, prefix in (("images_per_s", ""), ("images_per_cpu_s", "cpu_")):
        assert set(figures[rates_key]) == names
        for rates in figures[rates_key].values():
            assert len(rates) == 1 and all(rate > 0 for rate in rates)
        medians = {name: statistics.median(rates) for name, rates in figures[rates_key].items()}
        for baseline in ("ceiling", "tutorial"):
            ratios = figures[f"{prefix}ratio_to_{baseline}"]
            assert set(ratios) == names and ratios[baseline] == 1.0
            for name, ratio in ratios.items():
                assert abs(ratio - medians[name] / medians[baseline]) < 0.01 * ratio + 1e-3
    # The runs of the entrypoint report their test accuracy, and the baseline is set against the project in a line.
    assert set(figures["test_accuracy"]) == {"project", "baseline"}
    assert all(0 < accuracy <= 1 for values in figures["test_accuracy"].values() for accuracy in values)
    accuracy = figures["median_test_accuracy"]
    assert (f"baseline against project: {figures['ratio_to_project']['baseline']:.3f}x images/s, "
            f"{figures['cpu_ratio_to_project']['baseline']:.3f}x images/CPU-s; test accuracy "
            f"{accuracy['baseline']:.4f} against {accuracy['project']:.4f}") in proc.stdout
    # Steal is a share of the machine's CPU time (this test runs on Linux, where /proc/stat gives it).
    for shares in figures["steal_percent"].values():
        assert len(shares) == 1 and all(0 <= share <= 100 for share in shares)
    assert figures["cpu_cores"] >= 1 and figures["cpu_model"]
    # The printed headline carries the same ratio.
    assert f"project: {figures['ratio_to_ceiling']['project']:.3f} of the compute ceiling" in proc.stdout
    # The split of each round: a rate over the epochs after the first, and the fixed cost beyond them, which
    # together give back the round's wall time; `fit`'s tracing makes the project's cost positive.
    assert set(figures["steady_ratio_to_ceiling"]) == names and figures["steady_ratio_to_ceiling"]["ceiling"] == 1.0
    assert all(rate > 0 for rate in figures["median_steady_images_per_s"].values())
    assert all(seconds > 0 for seconds in figures["fixed_seconds"]["project"])
    assert f"project's epochs after the first: {figures['steady_ratio_to_ceiling']['project']:.3f}" in proc.stdout


def test_every_variant_is_the_run_with_valid_options():
    import throughput

    parser = config.build_parser("train_mnist_mirrored.py", "")
    defaults = config.validate(config.from_args(parser.parse_args([])))
    assert throughput.VARIANTS["project"] == []
    for name, options in throughput.VARIANTS.items():
        cfg = config.validate(config.from_args(parser.parse_args(options)))
        assert name == "project" or cfg != defaults, f"{name}'s options {options} change nothing"


def test_a_round_splits_into_later_epochs_and_a_fixed_cost():
    import throughput

    # 4 epochs of 100 images: the first took 1.5 s, the others 0.5, 0.6 and 0.5 s; fit's wall time 3.3 s.
    split = throughput.split_fixed_cost(400, 3.3, [1.5, 0.5, 0.6, 0.5])
    assert split["steady_images_per_s"] == 100 / 0.5
    assert abs(split["fixed_seconds"] - (3.3 - 4 * 0.5)) < 1e-9
    assert throughput.split_fixed_cost(100, 1.0, [1.0]) == {"steady_images_per_s": None, "fixed_seconds": None}


@pytest.mark.slow
def test_benchmark_rejects_an_unknown_variant(tmp_path, data_dir):
    proc = _bench("--data-dir", data_dir, "--variants", "warp_drive", "--output", str(tmp_path / "b.json"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "warp_drive" in proc.stderr
    assert not (tmp_path / "b.json").exists()


@pytest.mark.slow
def test_step_cost_alternates_the_variants_in_one_process(tmp_path, data_dir):
    out = tmp_path / "step_cost.json"
    proc = run_benchmark("step_cost.py", "--data-dir", data_dir, "--rounds", "2", "--steps", "2", "--output", str(out),
                         timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 2 and figures["steps_a_round"] >= 1
    assert set(figures["variants"]) == {"ceiling", "keras_memory", "keras_project",
                                        "keras_project_default", "keras_project_multiworker", "keras_streamed"}
    assert figures["variants"]["ceiling"]["ratio_to_ceiling"] == 1.0
    for name, variant in figures["variants"].items():
        low, high = variant["ratio_range"]
        assert variant["ms_a_step"] > 0 and variant["cpu_ms_a_step"] > 0 and low <= variant["ratio_to_ceiling"] <= high
        assert f"{name:<26} {variant['ms_a_step']:>10.3f}" in proc.stdout


@pytest.mark.slow
def test_phases_breaks_the_whole_command_down(tmp_path, data_dir):
    out = tmp_path / "phases.json"
    proc = run_benchmark("phases.py", "--data-dir", data_dir, "--epochs", "2", "--rounds", "1", "--output", str(out),
                         timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import phases

    command = json.loads(out.read_text())["commands"]["command"]
    seconds = command["phase_seconds"]
    # Every phase is printed and measured, and together they are the whole command, from its start to its exit.
    assert set(seconds) == set(phases.LABELS)
    for phase, label in phases.LABELS.items():
        assert label in proc.stdout and seconds[phase] >= 0
    assert abs(sum(seconds.values()) - command["wall_seconds"]) < 0.05
    assert seconds["first_epoch"] > 0 and seconds["later_epochs"] > 0 and command["cpu_seconds"] > 0
    # The ratios are the command's seconds over the ceiling's for the same images (rounded to the millisecond in
    # the file, so within 2 %), and its epochs' ratio.
    ratio = command["wall_seconds"] / command["ceiling_seconds"]
    assert abs(command["whole_over_ceiling"] - ratio) < 0.02 * ratio
    assert command["first_over_later_epoch"] == round(seconds["first_epoch"] / seconds["later_epochs"], 3)
    own = command["wall_seconds"] / (2 * seconds["later_epochs"])
    assert abs(command["whole_over_own_epochs"] - own) < 0.01 * own
    assert f"{command['whole_over_ceiling']:.3f}" in proc.stdout
