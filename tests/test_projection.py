"""The scaling projection, on the figures measured so far: its fit gives back the measured 1- and 2-worker steps,
its efficiencies behave as a data-parallel step's must, and its command line prints the table and draws the
picture, from its own figures or from a benchmarks/scaling.py results file. It builds model.py's model for the size of
its gradients; the rest is arithmetic."""

import json
import os
import subprocess
import sys
import types

import pytest

from processes import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import projection  # noqa: E402
import scaling  # noqa: E402  (its summarize() writes the results files the projection reads)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MEASURED_STEPS = projection.measured_steps(projection.MEASURED)
FAST_NETWORK = projection.grpc_over(projection.NETWORKS["100 Gb/s"])


def _project(*args):
    return subprocess.run([sys.executable, "benchmarks/projection.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _projected(capsys, *args):
    """projection.py's main in this process, where TensorFlow is already loaded (its refusals below run as
    processes of their own): its stdout."""
    assert projection.main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_the_measured_figures_are_the_ones_docs_quote():
    """1-replica and 2-worker step times from the benchmark's images/s, as docs/history.md gives them ("The fitted
    terms")."""
    steps = {(where.split()[1], batch): (round(one * 1e3, 1), round(two * 1e3, 1))
             for where, _, batch, one, two in MEASURED_STEPS}
    assert steps[("AMD", 64)] == (6.4, 14.3)
    assert steps[("x86-64", 64)] == (17.4, 24.3)
    assert steps[("x86-64", 256)] == (69.7, 82.8)
    # The all-reduce measured beside them moved the tutorial's model's gradients, in float32.
    assert projection.GRPC_GRADIENTS_BYTES == 4 * 347_146


def test_the_gradients_are_the_built_models_parameters_in_float32():
    import tensorflow as tf

    import data
    import model
    import train_mnist_mirrored

    image_shape, num_classes = data.image_shape_and_classes()
    net = model.build_model(image_shape, num_classes)
    train_mnist_mirrored.make_variables(tf, net, tf.TensorSpec(image_shape, tf.float32))  # a subclass's, at its call
    parameters, gradient_bytes, layers = projection.model_facts()
    assert parameters == net.count_params() == sum(count for _, count in layers)
    assert gradient_bytes == projection.gradient_bytes() == 4 * net.count_params()
    assert [name for name, _ in layers] == [type(layer).__name__ for layer in net.layers if layer.weights]


@pytest.mark.parametrize("as_launch", [False, True])
def test_fit_gives_back_the_measured_steps(as_launch):
    for _, _, _, one_s, two_s in MEASURED_STEPS:
        step = projection.fit(one_s, two_s, as_launch)
        assert step.seconds(1) == pytest.approx(one_s, rel=1e-12)
        assert step.seconds(2) == pytest.approx(two_s, rel=1e-12)
        assert step.fixed_s > 0


def test_fit_refuses_a_two_worker_step_faster_than_the_allreduce_allows():
    with pytest.raises(projection.UsageError, match="all-reduce"):
        projection.fit(10e-3, 10.5e-3)  # 0.5 ms more than one replica: less than a 4-byte all-reduce takes


def test_efficiency_is_one_alone_and_falls_with_workers():
    nccl = projection.Link(projection.NCCL_HOP_LATENCY_S, projection.NCCL_BUS_BYTES_PER_S)
    steps = [projection.Step(projection.GPU_STEP_S["central"], 0.0, nccl)]
    steps += [projection.dataclasses.replace(projection.fit(one, two), link=FAST_NETWORK)
              for _, _, _, one, two in MEASURED_STEPS]
    for step in steps:
        efficiencies = [step.efficiency(n) for n in projection.all_workers()]
        assert efficiencies[0] == 1.0
        assert all(later < earlier for earlier, later in zip(efficiencies, efficiencies[1:])), efficiencies


def test_efficiency_rises_with_bandwidth():
    one, two = MEASURED_STEPS[0][3:]
    fitted = projection.fit(one, two)
    slow, fast = (projection.dataclasses.replace(fitted, link=projection.Link(fitted.link.hop_latency_s, b))
                  for b in (0.1e9, 10e9))
    assert all(fast.efficiency(n) > slow.efficiency(n) for n in projection.WORKERS[1:])
    # Over a network the slower of gRPC's rate and the link's decides: a 1 Gb/s link costs, 100 Gb/s does not.
    one_gbit = projection.grpc_over(1e9 / 8)
    assert one_gbit.bytes_per_s == 1e9 / 8 and FAST_NETWORK.bytes_per_s == projection.GRPC_BYTES_PER_S
    assert (projection.dataclasses.replace(fitted, link=one_gbit).efficiency(64)
            < projection.dataclasses.replace(fitted, link=FAST_NETWORK).efficiency(64))


def test_efficiency_rises_with_batch():
    # In the model: more compute a step for the same communication.
    one, two = MEASURED_STEPS[0][3:]
    step = projection.fit(one, two)
    bigger = projection.dataclasses.replace(step, compute_s=4 * step.compute_s)
    assert all(bigger.efficiency(n) > step.efficiency(n) for n in projection.WORKERS[1:])
    # In the projection of what was measured: batch 256 over batch 64 on the 2-core x86-64 VM, every N past one, for
    # either split of the all-reduce's latency.
    rows = {(batch, label): band for batch, label, kind, _, band in projection.scenarios(projection.MEASURED)
            if kind == "cpu" and "x86-64" in label}
    compared = 0
    for (batch, label), band in rows.items():
        if batch == 64:
            for n in projection.WORKERS[1:]:
                assert all(big > small for big, small in zip(rows[(256, label)][n], band[n])), (label, n)
                compared += 1
    assert compared == len(projection.NETWORKS) * (len(projection.WORKERS) - 1)


def test_cli_prints_the_table_and_writes_the_picture(tmp_path, capsys):
    png = tmp_path / "projection.png"
    out = _projected(capsys, "--output", str(png))
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "per-replica batch 64" in out and "per-replica batch 256" in out
    assert all(f"N={n}" in out for n in projection.WORKERS)
    parameters, gradient_bytes, _ = projection.model_facts()
    assert f"model.py's model: {parameters:,} parameters" in out and f"{gradient_bytes:,} bytes" in out
    # The fit's check against what was measured, and the rows the docs quote.
    assert "1 replica 6.4, 2 workers 14.3" in out and "2-worker efficiency 0.45" in out
    epyc = next(line for line in out.splitlines() if line.startswith("CPU, 2-core AMD EPYC VM") and "10 Gb/s" in line)
    assert epyc.split()[-6:-4] == ["1.00", "0.45"]
    gpu = [line for line in out.splitlines() if line.startswith("GPUs, NCCL")]
    assert len(gpu) == 2


def test_cli_reads_a_scaling_results_file(tmp_path, capsys):
    """A results file as benchmarks/scaling.py writes it (its own summarize()), with the 2-core x86-64 VM's batch-64 rates."""
    def run(images_per_s):
        return {"images_per_s": images_per_s, "images_per_cpu_s": images_per_s}

    rates = {"1 replica": 3_682, "1 worker": 3_583, "2 workers": 5_271}
    rounds = {64: {name: [run(rate), run(rate)] for name, rate in rates.items()}}
    results = scaling.summarize(rounds, types.SimpleNamespace(epochs=2, steps_per_epoch=None, rounds=2))
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(results))  # as outputs.write_json does: the batch keys become strings
    png = tmp_path / "p.png"
    out = _projected(capsys, "--scaling", str(path), "--where", "a test machine", "--output", str(png))
    assert "a test machine" in out and "1 replica 17.4, 2 workers 24.3" in out
    assert "per-replica batch 256" not in out  # only what the file holds
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("content", ["not json", json.dumps({"batches": {"64": {"medians": {}}}})])
def test_cli_refuses_a_file_that_is_not_scaling_results(tmp_path, content):
    path = tmp_path / "scaling.json"
    path.write_text(content)
    png = tmp_path / "p.png"
    proc = _project("--scaling", str(path), "--output", str(png))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: --scaling")
    assert not png.exists()
