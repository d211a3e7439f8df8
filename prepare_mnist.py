"""MNIST without internet: the four standard IDX files turned into a prepared tfds data dir.

    python prepare_mnist.py --idx-dir DIR_WITH_IDX_FILES [--data-dir DIR]

tfds's own MNIST builder writes, versions and names the files, so `tfds.load('mnist', data_dir=DIR)` then reads
them with no network access; the training script does this itself when given --idx-dir.
"""

import argparse
import contextlib
import fcntl
import gzip
import math
import os
import sys
import tempfile

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.image_classification import mnist as tfds_mnist

from config import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, UsageError
from machinery import scratch, sigterm, terminal, tf_private

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic numbers: unsigned bytes, 3 dimensions (images) or 1 (labels).
IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}
HINT = "python prepare_mnist.py --idx-dir DIR_WITH_IDX_FILES"
LOCK = ".mnist-prepare.lock"  # in the data dir; tfds ignores it
# tfds writes into a temporary folder and renames it when whole: a prepare stopped before that leaves no dataset.
NOT_KEPT = "no half-written dataset was kept; run the same command again to prepare it"


def _idx_path(idx_dir, name):
    for candidate in (os.path.join(idx_dir, name + ".gz"), os.path.join(idx_dir, name)):
        if os.path.isfile(candidate):
            return candidate
    raise UsageError(f"{name}(.gz) is missing from {idx_dir}; put the four standard MNIST IDX files there")


def read_idx(path, ndim):
    """Reads one IDX file (gzip or raw) of unsigned bytes with `ndim` dimensions, checking every size."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise UsageError(f"{path} cannot be read ({err}); replace it with an intact copy") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"{path} is empty or shorter than an IDX header; replace it with an intact copy")
    magic = int.from_bytes(raw[:4], "big")
    if magic != IDX_MAGIC[ndim]:
        raise UsageError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (magic {magic:#010x}); "
                         "check that images and labels are not swapped")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) - header != math.prod(dims):
        raise UsageError(f"{path} holds {len(raw) - header} bytes of data but its header promises "
                         f"{math.prod(dims)} ({' x '.join(map(str, dims))}); it is truncated or corrupt, replace it")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def read_split(idx_dir, split, info):
    """One split's images and labels, checked against mnist's DatasetInfo (`info`): its image size and classes."""
    images_name, labels_name = IDX_FILES[split]
    images = read_idx(_idx_path(idx_dir, images_name), 3)
    labels = read_idx(_idx_path(idx_dir, labels_name), 1)
    height, width, _ = info.features["image"].shape
    num_classes = info.features["label"].num_classes
    if images.shape[1:] != (height, width):
        raise UsageError(f"{images_name} holds {images.shape[1]}x{images.shape[2]} images, not MNIST's "
                         f"{height}x{width}; replace it")
    if len(images) != len(labels):
        raise UsageError(f"{images_name} has {len(images)} images but {labels_name} has {len(labels)} labels; "
                         "use files from the same MNIST release")
    if len(images) == 0:
        raise UsageError(f"{images_name} holds no images; replace it with the real file")
    if labels.max() >= num_classes:
        raise UsageError(f"{labels_name} has label {labels.max()}, MNIST's are 0-{num_classes - 1}; replace it")
    return images, labels


class _MnistFromIdx(tfds_mnist.MNIST, skip_registration=True):
    """tfds's own MNIST builder (same name, version, features), fed from local IDX arrays instead of a download."""

    name = "mnist"

    def __init__(self, *, splits, **kwargs):
        self._arrays = splits
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(*arrays) for split, arrays in self._arrays.items()}

    def _generate_examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels)):
            yield index, {"image": image[..., None], "label": int(label)}


def is_prepared(builder):
    """builder.is_prepared(), without its warning that a dataset folder not yet made "has no dataset_info.json"
    (a first offline run printed it twice); a folder that exists without that file still warns."""
    return builder.data_path.exists() and builder.is_prepared()


@contextlib.contextmanager
def _prepare_lock(data_dir):
    """Runs started together on one (shared) data dir take turns to prepare it: one writes, the others wait."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, LOCK)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process preparing mnist in {data_dir} (it holds {path})", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


def made_tidily(make, *args, **kwargs):
    """`make(*args, **kwargs)`, a tfds builder, made with a temp dir of its own, removed afterwards: a builder that
    finds no prepared data makes an empty folder in the temp dir (it looks there for tfds's published metadata) and
    leaves it behind."""
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="mnist-builder-") as own:
        tempfile.tempdir = own
        try:
            return make(*args, **kwargs)
        finally:
            tempfile.tempdir = previous


def prepare(idx_dir, data_dir=None, *, exist_ok=False):
    """Writes a prepared `mnist` tfds dataset under data_dir from the IDX files in idx_dir; returns its path.

    With `exist_ok`, a data dir that another process prepared meanwhile is simply used.
    """
    if not os.path.isdir(idx_dir):
        raise UsageError(f"--idx-dir {idx_dir} is not a directory; point it at the folder with the MNIST IDX files")
    declared = made_tidily(tfds.builder, "mnist")  # what mnist holds, and where tfds keeps it by default
    splits = {split: read_split(idx_dir, split, declared.info) for split in IDX_FILES}
    root = data_dir or os.path.dirname(os.path.dirname(declared.data_dir))
    with _prepare_lock(root):
        # Made under the lock, so that it sees what a prepare that held the lock before wrote.
        builder = tf_private.without_prepare_lines(made_tidily(_MnistFromIdx, splits=splits, data_dir=data_dir))
        if is_prepared(builder):
            if exist_ok:
                return builder.data_dir
            raise UsageError(f"{builder.data_dir} already holds a prepared mnist; remove it first to prepare it again")
        print(f"preparing mnist in {root} from the IDX files in {idx_dir}", flush=True)
        # tfds writes into an "incomplete" temporary folder and renames it when done, so a killed prepare
        # leaves no half-written dataset behind.
        try:
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        except BaseException:
            # tfds's progress bar, stopped mid-way, leaves its line open: what follows starts on a line of its own.
            print(file=sys.stderr, flush=True)
            raise
        print(f"prepared mnist in {builder.data_dir}", flush=True)
    return builder.data_dir


# ---------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(prog="prepare_mnist.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idx-dir", required=True, help="folder holding train-images-idx3-ubyte(.gz) and the other three")
    parser.add_argument("--data-dir", default=None, help="tfds data dir to write (unset: tfds's own, ~/tensorflow_datasets)")
    parser.add_argument("--verbose", action="store_true", help="also show TensorFlow's start-up notices, held back otherwise")
    args = parser.parse_args(argv)
    # As the entrypoint: SIGTERM and Ctrl-C end it with one line, TensorFlow's start-up notices held back, and
    # every temporary file in one folder, removed at the end (a tfds builder leaves an empty one offline).
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else "tfds's default data dir"
    try:
        with sigterm.raised(), scratch.kept(f"prepare {data_dir}"):
            terminal.start_tensorflow(args.verbose)
            prepare(args.idx_dir, args.data_dir)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)
    except sigterm.Stopped:
        return terminal.stopped(EXIT_PREEMPTED, f"stopped (SIGTERM); {NOT_KEPT}")
    except KeyboardInterrupt:
        return terminal.stopped(EXIT_INTERRUPTED, f"interrupted; {NOT_KEPT}")
    print(f"train with: python train_mnist_mirrored.py --data-dir {args.data_dir or '~/tensorflow_datasets'}")
    return EXIT_OK


if __name__ == "__main__":
    sigterm.end_process(main())
