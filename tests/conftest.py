"""Shared fixtures: a tiny learnable dataset of the configured name (config.Config.dataset), prepared as tfds would,
its MNIST IDX files for the offline prepare, and one smoke run.

Nothing here reads ../shared or the network; every byte of data is made below, in the shape and classes the
dataset's DatasetInfo declares.
"""

import gzip
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NUM_TRAIN = 320
NUM_TEST = 64
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# The smoke run's flags; tests compare results.json against these, not against the code's own output.
SMOKE_EPOCHS = 1
SMOKE_STEPS = 3
SMOKE_BATCH = 16
# Mirror over two logical CPUs where the machine has two cores, so "global = per-replica x replicas" is
# checked with more than one replica; validate() refuses more replicas than cores.
SMOKE_CPU_REPLICAS = 2 if (os.cpu_count() or 1) >= 2 else 0

# Deadlines that only guard against a hang, generous for a loaded 2-core machine (TensorFlow alone takes 5-15 s
# to load there): a worker reaching a line of its output or a backup, and a signalled process's end (the product
# aims at well inside Kubernetes's 30 s grace period).
WAIT_SECONDS = 300
EXIT_SECONDS = 60


# ---------------------------------------------------------------- IDX writing helpers

def idx_images_bytes(images, count=None):
    """IDX3 of uint8: magic 0x00000803, count, rows, cols (big-endian), then the payload."""
    images = np.asarray(images, np.uint8)
    n = len(images) if count is None else count
    return struct.pack(">IIII", 0x00000803, n, images.shape[1], images.shape[2]) + images.tobytes()


def idx_labels_bytes(labels, count=None):
    """IDX1 of uint8: magic 0x00000801, count (big-endian), then the payload."""
    labels = np.asarray(labels, np.uint8)
    n = len(labels) if count is None else count
    return struct.pack(">II", 0x00000801, n) + labels.tobytes()


def write_gz(path, payload):
    with gzip.open(path, "wb") as f:
        f.write(payload)


def write_idx_dir(directory, arrays):
    """Writes the four standard gzip IDX files for {"train": (images, labels), "test": (...)}, images of one
    channel (MNIST's format)."""
    os.makedirs(directory, exist_ok=True)
    for split, (images, labels) in arrays.items():
        images_name, labels_name = IDX_NAMES[split]
        write_gz(os.path.join(directory, images_name + ".gz"), idx_images_bytes(np.asarray(images)[..., 0]))
        write_gz(os.path.join(directory, labels_name + ".gz"), idx_labels_bytes(labels))
    return str(directory)


def make_images(labels, rng, image_shape):
    """Each class is a distinct bright block on a 4x4 grid of positions (7x7 pixels in MNIST's 28x28), over
    faint noise, in every channel."""
    height, width, channels = image_shape
    rows, cols = height // 4, width // 4
    images = rng.integers(0, 40, size=(len(labels), height, width, channels), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, row * rows:(row + 1) * rows, col * cols:(col + 1) * cols] = rng.integers(
            200, 256, size=(rows, cols, channels))
    return images


def make_split(n, rng, image_shape=None, num_classes=None):
    """A learnable split of `n` examples: the configured dataset's image shape and classes unless given."""
    if image_shape is None:
        import data  # TensorFlow loads with it, so only once data is made

        image_shape, num_classes = data.image_shape_and_classes()
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.uint8)
    return make_images(labels, rng, image_shape), labels


def dataset_folder(data_dir):
    """Where tfds keeps the configured dataset in `data_dir`: DATA_DIR/NAME/VERSION."""
    from config import Config
    from machinery import tfds_builders

    return pathlib.Path(data_dir) / Config.dataset / str(tfds_builders.builder(Config.dataset).info.version)


def write_dataset(directory, arrays, name=None):
    """`arrays` ({"train": (images, labels), "test": ...}) as a prepared tfds dataset `name` (the configured one
    unless given) in the data dir `directory`; returns the data dir."""
    from config import Config
    from machinery import tfds_builders

    tfds_builders.write_prepared(name or Config.dataset, arrays, str(directory))
    return str(directory)


def cached_split(images, labels):
    """A training split cached from arrays, as input_engine.open_split caches a split that fits the memory limit:
    each example (uint8 image, int64 label) through data.scale, held in CPU variables. For the tests of the stream,
    whose examples need no tfds files."""
    import tensorflow as tf

    import data
    from machinery import input_engine

    examples = tf.data.Dataset.from_tensor_slices((images, labels)).map(data.scale)
    scaled = examples.batch(len(labels)).get_single_element()
    spec = tuple(tf.TensorSpec(tensor.shape[1:], tensor.dtype) for tensor in scaled)
    return input_engine.Split(None, "train", data.scale, spec, len(labels), input_engine.held(scaled))


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session", autouse=True)
def own_temp_dir(tmp_path_factory):
    """This process's temporary files (tfds's builders that the tests make, autograph's sources of the runs inside
    it, the test clusters' folders) in one folder, removed at the end, so that the suite leaves nothing in the
    machine's temp dir.
    What a run itself leaves is checked with a TMPDIR of its own (test_left_behind.py); pytest's tmp_path folders
    stay where pytest keeps them, for a failure to be looked at."""
    tmp_path_factory.getbasetemp()
    previous = tempfile.tempdir
    own = tempfile.mkdtemp(prefix="mnist-tests-")
    # Open to every user, as the temp dir is: munge refuses a socket below a folder others cannot enter.
    os.chmod(own, 0o755)
    tempfile.tempdir = own
    yield own
    tempfile.tempdir = previous
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(autouse=True)
def signal_mask_restored():
    """A test that calls `main()` in this process leaves SIGTERM blocked, as a finished run does (sigterm.watched);
    every process a later test starts would inherit that mask, and a daemon would then ignore the SIGTERM that
    stops it (Slurm's daemons waited out their 20 s stop deadline each)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def dataset_arrays():
    """The small dataset's splits, {split: (images, labels)}: uint8 images as tfds yields them."""
    rng = np.random.default_rng(1234)
    return {"train": make_split(NUM_TRAIN, rng), "test": make_split(NUM_TEST, rng)}


@pytest.fixture(scope="session")
def idx_dir(tmp_path_factory, dataset_arrays):
    """The small dataset as MNIST's four IDX files, for the offline prepare (prepare_mnist.py)."""
    return write_idx_dir(tmp_path_factory.mktemp("idx"), dataset_arrays)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, dataset_arrays):
    return write_dataset(tmp_path_factory.mktemp("tfds") / "data", dataset_arrays)


@pytest.fixture(scope="session")
def resume_data_dir(tmp_path_factory):
    """A larger split (1,600 training images), so that an epoch lasts long enough to be interrupted inside it."""
    rng = np.random.default_rng(99)
    return write_dataset(tmp_path_factory.mktemp("tfds_resume") / "data",
                         {"train": make_split(1600, rng), "test": make_split(64, rng)})


@pytest.fixture(scope="session")
def gpus_probed():
    """TensorFlow's first probe for GPUs in this process. Without a CUDA driver it logs a failed cuInit, which the
    entrypoint holds back only beside the notice TensorFlow prints at import; in pytest's process that came at
    collection, so the line would land in the stderr of whichever in-process test first starts TensorFlow."""
    from machinery import terminal

    terminal.start_tensorflow(verbose=False)


# What importing the entrypoint sets in a process's environment for itself (TensorFlow's allocator, tf.keras as
# tf_keras): a test that imports it leaves them in pytest's environment, and a process started after it, a Keras 3
# user's among them, must not inherit them; the entrypoint's own processes set them again.
SET_BY_THE_ENTRYPOINT = ("TF_CPU_ALLOCATOR_USE_BFC", "TF_USE_LEGACY_KERAS")


def subprocess_env():
    env = dict(os.environ)
    for name in ("TF_CONFIG", "PYTHONPATH", *SET_BY_THE_ENTRYPOINT):
        env.pop(name, None)
    return env


def run_benchmark(script, *args, timeout):
    """benchmarks/`script` with `args`, in a fresh process started from the project's folder as a user starts it."""
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def wait_until(condition, what, seconds=WAIT_SECONDS):
    """Polls `condition()` until it returns something true, and returns that; fails saying `what` it waited for
    after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def max_abs_diff(a, b):
    """The largest absolute difference between two lists of arrays (a model's weights, say)."""
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def free_ports(n, consecutive=False):
    """n ports nothing listens on now; `consecutive` for Slurm, whose workers on one node take base, base+1, ..."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            first = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", first + i if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue  # the next port up was taken; draw again
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports found in 100 draws")


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Worker:
    """One process of the entrypoint: the one way the tests start it. Its output goes to files (pipes nobody
    reads fill up and stall it), unbuffered so that a test can follow its progress, and its TMPDIR is a folder
    of its own, so a test sees what it leaves there."""

    def __init__(self, args, env, directory, name, run_in=(), script="train_mnist_mirrored.py", interruptible=False):
        """`run_in`: a command prefix that runs it elsewhere, e.g. on another host (tests/netns.py); `script`: the
        entrypoint or prepare_mnist.py. An `interruptible` one starts in a process group of its own with SIGINT's
        default action (a shell's background jobs ignore SIGINT, and their children inherit that), so that
        `interrupt()` is a terminal's Ctrl-C."""
        self.scratch = directory / name
        self.scratch.mkdir()
        self.stdout_path, self.stderr_path = directory / f"{name}.stdout", directory / f"{name}.stderr"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([*run_in, sys.executable, script, *args], cwd=ROOT,
                                         env={**subprocess_env(), "PYTHONUNBUFFERED": "1",
                                              "TMPDIR": str(self.scratch), **env},
                                         stdout=out, stderr=err, text=True, start_new_session=interruptible,
                                         preexec_fn=_sigint_default if interruptible else None)

    def interrupt(self):
        """Ctrl-C: SIGINT to the process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def stdout(self):
        return self.stdout_path.read_text()

    @property
    def stderr(self):
        return self.stderr_path.read_text()

    @property
    def last_stderr_line(self):
        return self.stderr.rstrip().splitlines()[-1]

    def wait_for(self, text, seconds=WAIT_SECONDS):
        """Returns once the worker has printed `text`; fails if it exits first, or after `seconds`."""
        def printed():
            if text in self.stdout:
                return True
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} before printing {text!r}:\n{self.stderr[-3000:]}")
            return False
        wait_until(printed, f"{text!r} from {self.stdout_path.stem}", seconds)


def finish(workers, timeout=400):
    """Waits for every worker (killing all of them if one hangs) and returns their exit statuses."""
    try:
        return [w.proc.wait(timeout=timeout) for w in workers]
    finally:
        for w in workers:
            w.proc.kill()


def run_entrypoint(args, directory, env=None, timeout=600):
    """Runs the entrypoint to its end, as a Worker of its own under `directory`; returns it."""
    name = tempfile.mkdtemp(prefix="run", dir=directory)
    os.rmdir(name)
    worker = Worker(args, env or {}, pathlib.Path(directory), os.path.basename(name))
    finish([worker], timeout)
    return worker


def backed_up_images(backup_dir):
    """The training images the backup in `backup_dir` has trained (0 without one), or None while its checkpoint
    is being replaced."""
    from machinery import resume

    try:
        position = resume.read(backup_dir)
    except Exception:  # noqa: BLE001 - read while the checkpoint was being replaced; look again
        return None
    return position.epoch * position.settings.epoch_images + position.image if position else 0


def images_at(output, what):
    """The training images done at each "<what> ... at epoch E, image I of N" in `output`: (E - 1) x N + I. The
    run says so where it stops after SIGTERM ("pre-empted (SIGTERM)") and where it resumes ("Resuming from")."""
    number = r"(\d[\d,]*)"
    found = re.findall(re.escape(what) + rf"[^\n]*? at epoch {number}, image {number} of {number}", output)
    return [(int(epoch) - 1) * int(size.replace(",", "")) + int(image.replace(",", ""))
            for epoch, image, size in found]


def wait_for_backup_after(backup_dir, images, running, seconds=WAIT_SECONDS):
    """Returns once a backup past `images` training images is on disk; fails if `running()` turns false first, or
    after `seconds`."""
    def backed_up():
        if (backed_up_images(backup_dir) or 0) > images:
            return True
        assert running(), f"the run ended before a backup past image {images}"
        return False
    wait_until(backed_up, f"backup past image {images}", seconds)


def skip_unless_ci(reason):
    """Skips a test the machine cannot run (no root, a package or daemon missing); CI, which must run every
    test (.ci/run installs what they need and sets CI), fails instead."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}, and CI must run this test")
    pytest.skip(reason)


def started(kind, *args, **kwargs):
    """kind(*args, **kwargs), for daemons or network namespaces; if they cannot start, skip_unless_ci."""
    try:
        return kind(*args, **kwargs)
    except (RuntimeError, subprocess.CalledProcessError) as err:
        skip_unless_ci(f"{kind.__name__} did not start: {getattr(err, 'stderr', None) or err}")


def apply_env(monkeypatch, variables):
    """Sets each of `variables` in the environment, or unsets it where its value is None."""
    for name, value in variables.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def assert_refused_in_one_line(status, stderr, words, output_dir):
    """Bad input: exit 2 and one `error:` line on stderr holding each of `words`, and nothing written."""
    lines = stderr.strip().splitlines()
    assert status == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not os.path.exists(output_dir)
    return lines[0]


def run_under_broken_tf_config(monkeypatch, tmp_path, capsys):
    """A multi-worker run's status and stderr line with an unreadable TF_CONFIG set beside whatever else the test
    set: TF_CONFIG wins over the other sources of workers, so its line is the one given."""
    import train_mnist_mirrored

    monkeypatch.setenv("TF_CONFIG", "{not json")
    status = train_mnist_mirrored.main(["--strategy", "multiworker", "--output-dir", str(tmp_path / "out")])
    return status, capsys.readouterr().err.strip()


def assert_one_port_warning(stderr, port):
    warnings = [line for line in stderr.splitlines() if "unauthenticated" in line]
    assert len(warnings) == 1 and f"port {port} " in warnings[0], stderr[-3000:]


def smoke_args(data_dir, output_dir):
    return ["--epochs", str(SMOKE_EPOCHS), "--steps-per-epoch", str(SMOKE_STEPS),
            "--batch-size-per-replica", str(SMOKE_BATCH), "--data-dir", data_dir, "--output-dir", output_dir]


class SmokeRun:
    def __init__(self, proc, output_dir):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.output_dir = output_dir

    def path(self, *names):
        return os.path.join(self.output_dir, *names)

    @property
    def results(self):
        with open(self.path("results.json")) as f:
            return json.load(f)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, data_dir):
    """The whole entrypoint, once, in its own process (logical devices and strategies are per process)."""
    output_dir = str(tmp_path_factory.mktemp("smoke") / "out")
    # With validation: the run also evaluates the test split at each epoch's end, across the replicas.
    args = smoke_args(data_dir, output_dir) + ["--validation"]
    if SMOKE_CPU_REPLICAS:
        args += ["--cpu-replicas", str(SMOKE_CPU_REPLICAS)]
    return SmokeRun(run_entrypoint(args, tmp_path_factory.mktemp("smoke_process")), output_dir)


@pytest.fixture(scope="session")
def smoke_ok(smoke_run):
    """The smoke run, for tests that only make sense once it succeeded."""
    assert smoke_run.returncode == 0, (
        f"smoke run failed (exit {smoke_run.returncode})\nstdout:\n{smoke_run.stdout[-4000:]}\n"
        f"stderr:\n{smoke_run.stderr[-4000:]}")
    return smoke_run


def final_weights(output_dir, epochs):
    """{variable name: array} of the model's layers in the last per-epoch checkpoint, which must be epoch `epochs`'s."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(os.path.join(output_dir, "training_checkpoints"))
    assert path.endswith(f"ckpt_{epochs}")
    ckpt = tf.train.load_checkpoint(path)
    names = sorted(n for n, _ in tf.train.list_variables(path) if n.startswith("layer_with_weights"))
    assert names, "the checkpoint must hold the model's layers"
    return {n: ckpt.get_tensor(n) for n in names}


# ---------------------------------------------------------------- deploy/'s Kubernetes manifests

INDEXED_JOB = os.path.join(ROOT, "deploy", "indexed-job.yaml")
JOBSET = os.path.join(ROOT, "deploy", "jobset.yaml")
TRAINJOB = os.path.join(ROOT, "deploy", "trainjob.yaml")


def documents(path):
    """{kind: document} of a manifest file."""
    import yaml

    with open(path) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def trainer_applied(runtime, trainjob):
    """The Job spec of the runtime's replicated job `node` as Kubeflow Trainer builds it for the TrainJob (its
    jobset and plainml plugins): numNodes pods, the TrainJob's command, and its env added to the container `node`;
    the JobSet's label that the runtime's env reads, resolved as the kubelet would (the JobSet has the TrainJob's
    name)."""
    import copy

    from machinery import worker_sources

    replicated, = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                   if r["name"] == worker_sources.TRAINJOB_REPLICATED_JOB]
    spec = copy.deepcopy(replicated["template"]["spec"])
    job = trainjob["spec"]["trainer"]
    spec["parallelism"] = spec["completions"] = job.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    container, = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "node"]
    container["command"] = job["command"]
    env = {var["name"]: var for var in container.get("env", []) + job.get("env", [])}
    labels = {worker_sources.TRAINJOB_NAME_LABEL: trainjob["metadata"]["name"]}
    for var in env.values():
        field = var.pop("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field:
            var["value"] = labels[re.fullmatch(r"metadata\.labels\['(.+)'\]", field)[1]]
    container["env"] = list(env.values())
    return spec


def job_specs():
    """(name, the Job's spec, its pods' host name with {index}, their subdomain) of each manifest; the TrainJob's
    Job is the one Trainer makes from it and its runtime."""
    from machinery import worker_sources

    indexed = documents(INDEXED_JOB)
    job, service = indexed["Job"], indexed["Service"]
    jobset = documents(JOBSET)["JobSet"]
    replicated = jobset["spec"]["replicatedJobs"][0]
    train = documents(TRAINJOB)
    name = train["TrainJob"]["metadata"]["name"]
    return [("indexed-job", job["spec"], job["metadata"]["name"] + "-{index}", service["metadata"]["name"]),
            ("jobset", replicated["template"]["spec"], f"{jobset['metadata']['name']}-{replicated['name']}-0-{{index}}",
             jobset["spec"]["network"]["subdomain"]),
            # JobSet's Service is named after the JobSet where the runtime names no subdomain.
            ("trainjob", trainer_applied(train["TrainingRuntime"], train["TrainJob"]),
             f"{name}-{worker_sources.TRAINJOB_REPLICATED_JOB}-0-{{index}}", name)]


def trainer(spec):
    """The one container of a Job spec's pods: the trainer."""
    container, = spec["template"]["spec"]["containers"]
    return container
