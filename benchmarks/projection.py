"""Scaling projected past two workers: a model of one data-parallel step, fitted to what
benchmarks/scaling.py measured on one replica and on two workers, then run out to 512 workers.

    python benchmarks/projection.py                                   # the figures measured so far (below)
    python benchmarks/projection.py --scaling benchmarks/scaling.json --where "the machine it ran on"

It prints the table of projected efficiencies and draws them to docs/scaling_projection.png.

The model. Each of N workers runs one replica with per-replica batch b; a synchronous step takes

    t(N) = t_compute + [N > 1] * (t_fixed + 2(N-1)·α + 2(N-1)/N · S/B)

- t_compute: one replica's step, the forward and backward pass and the update (what one replica measures);
- 2(N-1)·α + 2(N-1)/N · S/B: a ring all-reduce of the S bytes of float32 gradients (4 for each parameter of the
  model model.py builds), 2(N-1) steps of one hop's latency α each, and 2(N-1)/N · S bytes through each worker's
  link of bandwidth B (the formula NVIDIA's nccl-tests use to define "bus bandwidth", doc/PERFORMANCE.md);
- t_fixed: what else a worker of several pays per step and one replica does not (the collective's launch, waiting
  for the slower worker, the multi-device iterator): the part of the measured 2-worker step that the all-reduce's
  own two terms do not explain.

The efficiency is t_compute / t(N): N workers' images/s over N times one replica's, as scaling.py defines it.

The fit. Two measured points (one replica, two workers) fix two free terms: t_compute = the 1-replica step, and
t_fixed = the 2-worker step minus t_compute minus the all-reduce's two terms at N = 2. The all-reduce's α and B
come from a separate measurement (benchmarks/allreduce.py): two pinned one-thread workers all-reducing over
loopback a 4-byte tensor, which is latency and launch only, and the tutorial model's gradients, whose extra time
is the bytes' (B); the figures and their derivation are in docs/history.md, "The fitted terms". Two measured
points cannot tell how the 4-byte time splits into per-hop latency and a launch paid once, so both ends are
projected: all of it 2 hops of latency (α half the 4-byte time, the line), or all of it launch, in t_fixed (α then the
network's alone; the top of the band). On a network, the gRPC transport's CPU cost per byte and the link's
overlap, so the slower of the two decides the bytes' time, and the network's hop latency adds to α.

GPUs with NCCL use published figures instead (cited in docs/history.md, "Networks and GPUs"): the bus bandwidth
and the per-hop latency of NCCL's ring across nodes; their compute time is an assumption (no GPU was lent), given
as a range.

The step times listed below were measured on the tutorial's model. For a model of your own, measure it
(benchmarks/scaling.py) and pass --scaling: the gradients' size always comes from the model model.py builds.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machinery import terminal  # noqa: E402  (it and exits import nothing heavy)
from machinery.exits import EXIT_BAD_INPUT, EXIT_OK, UsageError  # noqa: E402

WORKERS = (1, 2, 4, 8, 64, 512)  # the table's columns; the picture draws every power of two up to the last
OUTPUT = os.path.join(ROOT, "docs", "scaling_projection.png")

# TensorFlow's ring over gRPC between two pinned one-thread workers on loopback, nothing else running
# (the 2-core x86-64 VM, docs/history.md "Where a two-worker step goes").
GRPC_TINY_ALLREDUCE_S = 0.75e-3  # a 4-byte all-reduce: no bytes to speak of, so latency and launch only
GRPC_GRADIENTS_ALLREDUCE_S = 2.9e-3  # the tutorial's model's gradients...
GRPC_GRADIENTS_BYTES = 1_388_584  # ...which are these bytes: its parameters in float32
GRPC_HOP_LATENCY_S = GRPC_TINY_ALLREDUCE_S / 2  # 2(N-1) = 2 hops at N = 2
GRPC_BYTES_PER_S = GRPC_GRADIENTS_BYTES / (GRPC_GRADIENTS_ALLREDUCE_S - GRPC_TINY_ALLREDUCE_S)  # 2(N-1)/N = 1 at N = 2
NETWORK_HOP_LATENCY_S = 20e-6  # assumed: one TCP hop through a data-centre switch, a few tens of microseconds
NETWORKS = {"10 Gb/s": 10e9 / 8, "100 Gb/s": 100e9 / 8}  # link bandwidth, bytes/s

# NCCL's ring across nodes, from published figures (sources and derivation: docs/history.md, "Networks and GPUs").
# Bus bandwidth: NVIDIA's all-reduce on DGX A100 nodes over InfiniBand (github.com/NVIDIA/nccl/issues/812). Hop
# latency: a 1 MB all-reduce of 40 H100 ranks forced to the ring (github.com/NVIDIA/nccl/issues/1368), less its
# bytes' time, over its 2(40-1) hops.
NCCL_BUS_BYTES_PER_S = 192e9
NCCL_HOP_LATENCY_S = 4.4e-6
# Assumed, not measured: one GPU's step for the tutorial's model at batch 64 or 256. Its arithmetic takes a
# data-centre GPU a small part of that, so the step is TensorFlow's own per-step cost (kernel launches, the
# executor, the input), which no figure here pins down (docs/history.md, "Networks and GPUs").
GPU_STEP_S = {"low": 0.5e-3, "central": 1e-3, "high": 2e-3}

# What benchmarks/scaling.py measured on the tutorial's model (medians of train_images_per_s over 2 rounds, 2 epochs a run, tracing and
# callbacks included): per-replica batch -> (1 replica, 2 workers) images/s.
MEASURED = (
    {"where": "2-core AMD EPYC VM (family 26)", "when": "scaling.py, 2 rounds", "batches": {64: (10_012, 8_966)}},
    {"where": "2-core x86-64 VM", "when": "scaling.py, 2 rounds",
     "batches": {64: (3_682, 5_271), 256: (3_672, 6_182)}},
)


def built_model():
    """The model model.py builds, as the run builds it: for the image shape and classes tfds's DatasetInfo gives."""
    import train_mnist_mirrored  # sets TensorFlow's environment, as a run does

    terminal.start_tensorflow(verbose=False)  # its start-up notices held back, as in a run
    import data
    import model
    import tensorflow as tf

    image_shape, num_classes = data.image_shape_and_classes()
    net = model.build_model(image_shape, num_classes)
    # A model that makes its variables at its first call (a subclassed one) makes them now, as the run's do.
    train_mnist_mirrored.make_variables(tf, net, tf.TensorSpec(image_shape, tf.float32))
    return net


@functools.lru_cache(maxsize=None)
def model_facts():
    """(parameters, the bytes of their float32 gradients, [(layer, parameters)] of the layers that have any) of
    the model model.py builds."""
    net = built_model()
    layers = [(type(layer).__name__, layer.count_params()) for layer in net.layers if layer.count_params()]
    return net.count_params(), 4 * net.count_params(), layers


def gradient_bytes():
    return model_facts()[1]


@dataclasses.dataclass(frozen=True)
class Link:
    """The all-reduce's two terms: one hop's latency, and the bandwidth each worker moves the bytes at."""
    hop_latency_s: float
    bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class Step:
    """One worker's step: the fitted (or assumed) compute and fixed terms, and the all-reduce's link."""
    compute_s: float
    fixed_s: float
    link: Link

    def seconds(self, workers):
        if workers == 1:
            return self.compute_s
        hops = 2 * (workers - 1)
        return (self.compute_s + self.fixed_s + hops * self.link.hop_latency_s
                + hops / workers * gradient_bytes() / self.link.bytes_per_s)

    def efficiency(self, workers):
        return self.compute_s / self.seconds(workers)


def loopback(as_launch=False):
    """The link the 2-worker figures were measured over."""
    return Link(0.0 if as_launch else GRPC_HOP_LATENCY_S, GRPC_BYTES_PER_S)


def grpc_over(link_bytes_per_s, as_launch=False):
    """TensorFlow's gRPC ring across a network: its CPU cost per byte and the link's overlap, the slower decides."""
    return Link(loopback(as_launch).hop_latency_s + NETWORK_HOP_LATENCY_S,
                min(GRPC_BYTES_PER_S, link_bytes_per_s))


def fit(one_replica_s, two_workers_s, as_launch=False):
    """The step whose 1- and 2-worker times on loopback are exactly the measured ones."""
    link = loopback(as_launch)
    allreduce_s = Step(0.0, 0.0, link).seconds(2)
    fixed_s = two_workers_s - one_replica_s - allreduce_s
    if fixed_s < 0:
        raise UsageError(f"the 2-worker step ({two_workers_s * 1e3:.1f} ms) is less than one replica's "
                         f"({one_replica_s * 1e3:.1f} ms) plus the all-reduce's {allreduce_s * 1e3:.2f} ms "
                         "measured on another machine; fit only figures of a machine like it")
    return Step(one_replica_s, fixed_s, link)


def step_seconds(batch, images_per_s, workers):
    return batch * workers / images_per_s


def measured_steps(measured):
    """[(where, when, batch, 1-replica step s, 2-worker step s)] from MEASURED-shaped records."""
    return [(m["where"], m["when"], batch, step_seconds(batch, one, 1), step_seconds(batch, two, 2))
            for m in measured for batch, (one, two) in sorted(m["batches"].items())]


def read_scaling(path, where):
    """A benchmarks/scaling.py results file as one MEASURED record; when = the file's modification time."""
    try:
        with open(path) as f:
            results = json.load(f)
        batches = {int(batch): (figures["medians"]["1 replica"]["images_per_s"],
                                figures["medians"]["2 workers"]["images_per_s"])
                   for batch, figures in results["batches"].items()}
    except OSError as err:
        raise UsageError(f"--scaling {path}: {err.strerror}; pass a benchmarks/scaling.py results file") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"--scaling {path} is not a benchmarks/scaling.py results file; "
                         "make one with python benchmarks/scaling.py --data-dir DIR") from None
    if not batches:
        raise UsageError(f"--scaling {path} holds no batch sizes; run benchmarks/scaling.py with --batches")
    when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return {"where": where, "when": when.strftime("%Y-%m-%d %H:%M UTC (file written)"), "batches": batches}


def scenarios(measured):
    """[(batch, label, kind, {workers: efficiency}, {workers: (low, high)})]: CPU workers per measured machine and
    network, their range from the two splits of the 4-byte all-reduce's time (all per-hop latency, the line; all
    launch), and GPUs with NCCL, their range from the low and high assumed GPU step."""
    rows = []
    for where, when, batch, one_s, two_s in measured_steps(measured):
        for network, link_bytes_per_s in NETWORKS.items():
            steps = [dataclasses.replace(fit(one_s, two_s, as_launch), link=grpc_over(link_bytes_per_s, as_launch))
                     for as_launch in (False, True)]
            rows.append((batch, f"CPU, {where} ({when}), {network}", "cpu",
                         {n: steps[0].efficiency(n) for n in all_workers()},
                         {n: tuple(step.efficiency(n) for step in steps) for n in all_workers()}))
    nccl = Link(NCCL_HOP_LATENCY_S, NCCL_BUS_BYTES_PER_S)
    gpu = {name: Step(seconds, 0.0, nccl) for name, seconds in GPU_STEP_S.items()}
    for batch in sorted({batch for _, _, batch, _, _ in measured_steps(measured)}):
        rows.append((batch, f"GPUs, NCCL's ring across nodes, step {GPU_STEP_S['central'] * 1e3:g} ms (assumed)", "gpu",
                     {n: gpu["central"].efficiency(n) for n in all_workers()},
                     {n: (gpu["high"].efficiency(n), gpu["low"].efficiency(n)) for n in all_workers()}))
    return rows


def all_workers():
    return [2 ** k for k in range(WORKERS[-1].bit_length())]


def print_model():
    parameters, bytes_, layers = model_facts()
    print(f"model.py's model: {parameters:,} parameters ({', '.join(f'{name} {count:,}' for name, count in layers)}), "
          f"so {bytes_:,} bytes of float32 gradients all-reduced a step")


def print_fit(measured):
    print("fitted terms (ms): one replica's step = t_compute; 2 workers' = t_compute + t_fixed + the all-reduce's")
    for where, when, batch, one_s, two_s in measured_steps(measured):
        latency, launch = fit(one_s, two_s), fit(one_s, two_s, as_launch=True)
        print(f"  {where}, {when}, batch {batch}: 1 replica {one_s * 1e3:.1f}, 2 workers {two_s * 1e3:.1f}"
              f" = {latency.compute_s * 1e3:.1f} + t_fixed {latency.fixed_s * 1e3:.2f} (or {launch.fixed_s * 1e3:.2f}"
              f" with the launch) + all-reduce {(two_s - one_s - latency.fixed_s) * 1e3:.2f};"
              f" 2-worker efficiency {one_s / two_s:.2f}")
    print(f"  all-reduce: α {GRPC_HOP_LATENCY_S * 1e3:.3f} a hop (or 0, the 4-byte time all launch), "
          f"B {GRPC_BYTES_PER_S / 1e9:.2f} GB/s; on a network α + {NETWORK_HOP_LATENCY_S * 1e6:g} us, "
          f"B = min(B, link)")


def span(pair):
    low, high = f"{min(pair):.2f}", f"{max(pair):.2f}"
    return low if low == high else f"{low}-{high}"


def print_table(rows):
    header = "".join(f"{f'N={n}':>18}" for n in WORKERS)
    for batch in sorted({row[0] for row in rows}):
        print(f"\nper-replica batch {batch}: projected efficiency (N workers' images/s / N x one replica's)")
        print(f"{'':<66}{header}")
        for row_batch, label, kind, efficiency, band in rows:
            if row_batch != batch:
                continue
            cells = [span(band[n]) if kind == "cpu" else f"{efficiency[n]:.2f} ({span(band[n])})" for n in WORKERS]
            print(f"{label:<66}" + "".join(f"{cell:>18}" for cell in cells))
    print("\nCPU: the range is the 4-byte all-reduce's time taken as per-hop latency (low) or as launch (high); "
          "GPU: the step assumed, its range from "
          f"{GPU_STEP_S['low'] * 1e3:g} ms (low) to {GPU_STEP_S['high'] * 1e3:g} ms (high)")


def draw(rows, measured, path):
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    batches = sorted({row[0] for row in rows})
    workers = all_workers()
    fig, axes = plt.subplots(1, len(batches), figsize=(4.8 * len(batches), 4.2), sharey=True, squeeze=False)
    colours = iter(["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:red"])
    machine_colour = {}
    for ax, batch in zip(axes[0], batches):
        lines = {}  # machine -> [(networks, efficiency, band)]: networks that project the same share one line
        for row_batch, label, kind, efficiency, band in rows:
            if row_batch != batch:
                continue
            machine, network = label.rsplit(", ", 1) if kind == "cpu" else (label, None)
            same = [line for line in lines.setdefault(machine, []) if line[1] == efficiency and line[2] == band]
            if same:
                same[0][0].append(network)
            else:
                lines[machine].append(([network], efficiency, band))
        for machine, drawn in lines.items():
            if machine.startswith("CPU") and machine not in machine_colour:
                machine_colour[machine] = next(colours)
            colour = machine_colour.get(machine, "tab:green")
            for index, (networks, efficiency, band) in enumerate(drawn):
                ax.fill_between(workers, [min(band[n]) for n in workers], [max(band[n]) for n in workers],
                                color=colour, alpha=0.18 if index == 0 else 0.08, linewidth=0)
                label = machine if networks == [None] else f"{machine}, {' or '.join(networks)}"
                ax.plot(workers, [efficiency[n] for n in workers], color=colour, linestyle="-:"[index % 2],
                        label=label)
        for where, when, b, one_s, two_s in measured_steps(measured):
            if b == batch:
                ax.plot([2], [one_s / two_s], "o", color=machine_colour[f"CPU, {where} ({when})"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("workers, one replica each")
        ax.set_title(f"per-replica batch {batch}", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("efficiency: images/s ÷ (N × one replica's)")
    legend = {}
    for ax in axes[0]:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    labels = list(legend)
    fig.legend([legend[label] for label in labels], labels, loc="lower center", fontsize=8, frameon=False)
    fig.suptitle(f"model.py's model, {model_facts()[0]:,} parameters, projected (CPU workers: TensorFlow's gRPC "
                 "ring; dots: measured; bands: docs/history.md)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.045 * len(labels) + 0.02, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling", help="a benchmarks/scaling.py results file (default: the figures measured "
                                          "so far, listed in this script)")
    parser.add_argument("--where", default="this machine", help="with --scaling: the machine it was measured on")
    parser.add_argument("--output", default=OUTPUT, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        measured = [read_scaling(args.scaling, args.where)] if args.scaling else MEASURED
        print_model()
        print_fit(measured)
        rows = scenarios(measured)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)
    print_table(rows)
    draw(rows, measured, args.output)
    print(f"\npicture written to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
