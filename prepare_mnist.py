"""MNIST without internet: the four standard IDX files turned into a prepared tfds data dir.

    python prepare_mnist.py --idx-dir DIR_WITH_IDX_FILES [--data-dir DIR] [--dataset NAME]

The files are written as tfds's own dataset would be (its name, version, features and file names), so
`tfds.load(NAME, data_dir=DIR)` then reads them with no network access; the training script does this itself when
given --idx-dir. This prepare is MNIST's: IDX files hold 28x28 grayscale images, as MNIST and Fashion-MNIST ship
them. A dataset of another kind (CIFAR-10, say) is prepared by tfds itself where there is internet.
"""

import argparse
import gzip
import math
import os

import numpy as np

from config import Config
from machinery import scratch, sigterm, terminal, tfds_builders
from machinery.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, UsageError

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic numbers: unsigned bytes, 3 dimensions (images) or 1 (labels).
IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}
HINT = "python prepare_mnist.py --idx-dir DIR_WITH_IDX_FILES"
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


def hint(name, data_dir="DIR"):
    """How to prepare the dataset `name` offline into `data_dir`: this command for a dataset of MNIST's kind, tfds's
    own where there is internet for any other."""
    if tfds_builders.builder(name).info.features["image"].shape[-1] != 1:
        return f"prepare it where there is internet with: tfds build {name} --data_dir {data_dir}, and copy it here"
    dataset = "" if name == Config.dataset else f" --dataset {name}"
    return f"run: {HINT}{dataset} --data-dir {data_dir}, or pass --idx-dir DIR_WITH_IDX_FILES"


def refuse_another_kind(name, info):
    """IDX files hold grayscale images of one size: a dataset whose images are another kind is not prepared so."""
    height, width, channels = info.features["image"].shape
    if channels != 1:
        raise UsageError(f"{name}'s images are {height}x{width}x{channels}, and IDX files hold MNIST's grayscale "
                         f"images only; prepare {name} with tfds where there is internet (tfds build {name} "
                         "--data_dir DIR) and pass --data-dir DIR")


def read_split(idx_dir, split, name, info):
    """One split's images (N, height, width, 1) and labels, checked against the dataset's DatasetInfo (`info`): its
    image size and classes."""
    images_name, labels_name = IDX_FILES[split]
    images = read_idx(_idx_path(idx_dir, images_name), 3)
    labels = read_idx(_idx_path(idx_dir, labels_name), 1)
    height, width, _ = info.features["image"].shape
    num_classes = info.features["label"].num_classes
    if images.shape[1:] != (height, width):
        raise UsageError(f"{images_name} holds {images.shape[1]}x{images.shape[2]} images, not {name}'s "
                         f"{height}x{width}; replace it")
    if len(images) != len(labels):
        raise UsageError(f"{images_name} has {len(images)} images but {labels_name} has {len(labels)} labels; "
                         f"use files from the same {name} release")
    if len(images) == 0:
        raise UsageError(f"{images_name} holds no images; replace it with the real file")
    if labels.max() >= num_classes:
        raise UsageError(f"{labels_name} has label {labels.max()}, {name}'s are 0-{num_classes - 1}; replace it")
    return images[..., None], labels


def prepare(idx_dir, data_dir=None, *, name=Config.dataset, exist_ok=False):
    """Writes a prepared tfds dataset `name` under data_dir from the IDX files in idx_dir; returns its path.

    With `exist_ok`, a data dir that another process prepared meanwhile is simply used.
    """
    if not os.path.isdir(idx_dir):
        raise UsageError(f"--idx-dir {idx_dir} is not a directory; point it at the folder with the IDX files")
    info = tfds_builders.builder(name).info  # what the dataset holds
    refuse_another_kind(name, info)
    splits = {split: read_split(idx_dir, split, name, info) for split in IDX_FILES}
    return tfds_builders.write_prepared(name, splits, data_dir, exist_ok=exist_ok,
                                        source=f" from the IDX files in {idx_dir}")


# ---------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(prog="prepare_mnist.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idx-dir", required=True, help="folder holding train-images-idx3-ubyte(.gz) and the other three")
    parser.add_argument("--data-dir", default=None, help="tfds data dir to write (unset: tfds's own, ~/tensorflow_datasets)")
    parser.add_argument("--dataset", default=Config.dataset, help="tfds name to prepare it as, a dataset of MNIST's "
                                                                  f"format (default: {Config.dataset})")
    parser.add_argument("--verbose", action="store_true", help="also show TensorFlow's start-up notices, held back otherwise")
    args = parser.parse_args(argv)
    # As the entrypoint: SIGTERM and Ctrl-C end it with one line, TensorFlow's start-up notices held back, and
    # every temporary file in one folder, removed at the end (a tfds builder leaves an empty one offline).
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else "tfds's default data dir"
    try:
        with sigterm.raised(), scratch.kept(f"prepare {data_dir}"):
            terminal.start_tensorflow(args.verbose)
            prepare(args.idx_dir, args.data_dir, name=args.dataset)
    except UsageError as err:
        return terminal.stopped(EXIT_BAD_INPUT, err)
    except sigterm.Stopped:
        return terminal.stopped(EXIT_PREEMPTED, f"stopped (SIGTERM); {NOT_KEPT}")
    except KeyboardInterrupt:
        return terminal.stopped(EXIT_INTERRUPTED, f"interrupted; {NOT_KEPT}")
    dataset = "" if args.dataset == Config.dataset else f" --dataset {args.dataset}"
    print(f"train with: python train_mnist_mirrored.py --data-dir {args.data_dir or '~/tensorflow_datasets'}{dataset}")
    return EXIT_OK


if __name__ == "__main__":
    sigterm.end_process(main())
