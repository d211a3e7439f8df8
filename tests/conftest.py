"""The suite's fixtures: a tiny learnable dataset of the configured name (config.Config.dataset), prepared as tfds
would, its MNIST IDX files for the offline prepare, one smoke run, and the state each test leaves put back.

Only fixtures and pytest's hooks live here; the helpers they build on are in the modules named for what they make:
small_data.py (the datasets), processes.py (the process harness), runs.py (whole runs and their results),
manifests.py (deploy/'s Kubernetes manifests).
"""

import os
import shutil
import signal
import sys
import tempfile

import numpy as np
import pytest

from processes import ROOT, run_entrypoint

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the product's modules, for the tests and the helpers that import them

from runs import SMOKE_CPU_REPLICAS, SmokeRun, smoke_args  # noqa: E402
from small_data import NUM_TEST, NUM_TRAIN, make_split, write_dataset, write_idx_dir  # noqa: E402


# The files whose tests take longest (the `--durations` list at each run's end says which; the smoke run is the
# fast tier's longest), started first, then the other files with slow tests, then the fast ones: the workers
# (pytest.ini) take whole files in this order, so that the short files at the end fill the gaps and all finish
# together. A name missing here only costs time.
LONGEST_FIRST = ("test_slurm.py", "test_left_behind.py", "test_sigterm_sweep.py", "test_preemption.py",
                 "test_resize.py", "test_benchmark.py", "test_scaling.py", "test_indexed_job.py",
                 "test_separate_hosts.py", "test_smoke_run.py")


# The files whose tests use the smoke run (a session fixture: made once per worker that asks for it), taken by one
# worker together, so that it is made once. A name missing here only costs time.
SMOKE_RUN_FILES = ("test_sigterm_sweep.py", "test_smoke_run.py", "test_cli_errors.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's whole-file scheduling (pytest.ini), with SMOKE_RUN_FILES one unit of work."""
    from xdist.scheduler import LoadFileScheduling

    if config.getvalue("dist") != "loadfile":
        return None  # another --dist given on the command line: xdist's own

    class SmokeRunFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SMOKE_RUN_FILES[0] if os.path.basename(scope) in SMOKE_RUN_FILES else scope

    return SmokeRunFilesTogether(config, log)


def pytest_collection_modifyitems(items):
    slow_files = {item.path.name for item in items if item.get_closest_marker("slow")}

    def rank(item):
        name = item.path.name
        return (LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST), name not in slow_files)
    items.sort(key=rank)  # stable: each file's tests keep their order, and its module fixtures their sharing


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
