"""MNIST's offline prepare (prepare_mnist.py), from the four IDX files, and its refusals of bad input: the
dataset's format is MNIST's here, whatever its name."""

import gzip
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

import data
import prepare_mnist
from config import Config
from processes import subprocess_env
from small_data import IDX_NAMES, NUM_TEST, NUM_TRAIN, idx_images_bytes, idx_labels_bytes, write_gz, write_idx_dir

IMAGE_SHAPE, NUM_CLASSES = data.image_shape_and_classes()  # what tfds's DatasetInfo says the dataset holds


def as_set(images, labels):
    return sorted((int(label), np.asarray(image, np.uint8).reshape(IMAGE_SHAPE[:2]).tobytes())
                  for image, label in zip(images, labels))


# ---------------------------------------------------------------- round trip

def test_prepared_dir_reads_back_exactly_what_was_written(data_dir, dataset_arrays):
    datasets, info = tfds.load(Config.dataset, data_dir=data_dir, with_info=True, as_supervised=True)
    assert info.splits["train"].num_examples == NUM_TRAIN
    assert info.splits["test"].num_examples == NUM_TEST
    for split in ("train", "test"):
        images, labels = dataset_arrays[split]
        read = list(tfds.as_numpy(datasets[split]))
        assert len(read) == len(labels)
        assert all(image.shape == IMAGE_SHAPE and image.dtype == np.uint8 for image, _ in read)
        assert as_set([i for i, _ in read], [l for _, l in read]) == as_set(images, labels)


def test_data_load_uses_the_prepared_dir(data_dir):
    info = data.load(Config.dataset, data_dir)
    datasets = tfds.load(Config.dataset, data_dir=data_dir, as_supervised=True)
    assert info.splits["train"].num_examples == NUM_TRAIN
    image, label = next(iter(datasets["test"]))
    assert tuple(image.shape) == IMAGE_SHAPE
    assert 0 <= int(label) < NUM_CLASSES


def test_prepare_refuses_an_already_prepared_dir(data_dir, idx_dir, capsys):
    rc = prepare_mnist.main(["--idx-dir", idx_dir, "--data-dir", data_dir])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1 and err[0].startswith("error:") and "already" in err[0]
    # ... and the existing dataset is still whole.
    assert tfds.builder(Config.dataset, data_dir=data_dir).is_prepared()
    assert tfds.builder(Config.dataset, data_dir=data_dir).info.splits["train"].num_examples == NUM_TRAIN


# ---------------------------------------------------------------- prepare_mnist.py with no files

@pytest.mark.slow
def test_prepare_cli_without_idx_files_fails_cleanly(root, tmp_path):
    empty = tmp_path / "no_idx_here"
    empty.mkdir()
    target = tmp_path / "target"
    proc = subprocess.run([sys.executable, "prepare_mnist.py", "--idx-dir", str(empty), "--data-dir", str(target)],
                          cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:")
    assert "missing" in last
    assert not target.exists()


# ---------------------------------------------------------------- bad IDX input

def _copy_good(idx_dir, tmp_path):
    bad = tmp_path / "idx"
    shutil.copytree(idx_dir, bad)
    return bad


def _gz(split, kind):
    return IDX_NAMES[split][0 if kind == "images" else 1] + ".gz"


def _missing(d, arrays):
    os.remove(d / _gz("test", "labels"))
    return ["t10k-labels-idx1-ubyte", "missing"]


def _empty(d, arrays):
    write_gz(d / _gz("train", "images"), b"")
    return ["train-images-idx3-ubyte", "empty"]


def _empty_raw(d, arrays):
    # A raw (not gzip) file is accepted too; an empty one must be refused the same way.
    os.remove(d / _gz("test", "images"))
    (d / IDX_NAMES["test"][0]).write_bytes(b"")
    return ["t10k-images-idx3-ubyte", "empty"]


def _truncated(d, arrays):
    images, _ = arrays["train"]
    payload = idx_images_bytes(images)
    write_gz(d / _gz("train", "images"), payload[: len(payload) - int(np.prod(IMAGE_SHAPE)) * 5])  # header still says 320
    return ["train-images-idx3-ubyte", "truncated"]


def _count_mismatch(d, arrays):
    _, labels = arrays["train"]
    write_gz(d / _gz("train", "labels"), idx_labels_bytes(labels[:-1]))
    return ["train-labels-idx1-ubyte", str(len(labels) - 1), str(len(labels))]


def _swapped(d, arrays):
    images_path, labels_path = d / _gz("test", "images"), d / _gz("test", "labels")
    images_bytes, labels_bytes = images_path.read_bytes(), labels_path.read_bytes()
    images_path.write_bytes(labels_bytes)
    labels_path.write_bytes(images_bytes)
    return ["t10k-images-idx3-ubyte", "swapped"]


def _not_gzip(d, arrays):
    (d / _gz("train", "labels")).write_bytes(b"this is not gzip data at all")
    return ["train-labels-idx1-ubyte", "cannot be read"]


def _truncated_gzip(d, arrays):
    path = d / _gz("test", "images")
    payload = path.read_bytes()
    path.write_bytes(payload[: len(payload) // 2])  # the gzip stream itself ends early
    return ["t10k-images-idx3-ubyte", "cannot be read"]


def _wrong_image_size(d, arrays):
    images, _ = arrays["train"]
    height, width, _ = IMAGE_SHAPE
    write_gz(d / _gz("train", "images"), idx_images_bytes(np.pad(images[..., 0], ((0, 0), (0, 1), (0, 2)))))
    return ["train-images-idx3-ubyte", f"{height + 1}x{width + 2} images", f"not {Config.dataset}'s {height}x{width}"]


def _label_out_of_range(d, arrays):
    _, labels = arrays["test"]
    labels = labels.copy()
    labels[3] = NUM_CLASSES
    write_gz(d / _gz("test", "labels"), idx_labels_bytes(labels))
    return ["t10k-labels-idx1-ubyte", f"label {NUM_CLASSES}", f"0-{NUM_CLASSES - 1}"]


@pytest.mark.parametrize("corrupt", [_missing, _empty, _empty_raw, _truncated, _count_mismatch, _swapped,
                                     _not_gzip, _truncated_gzip, _wrong_image_size, _label_out_of_range],
                         ids=lambda f: f.__name__.strip("_"))
def test_prepare_refuses_bad_idx_input(corrupt, idx_dir, dataset_arrays, tmp_path, capsys):
    bad = _copy_good(idx_dir, tmp_path)
    expected_words = corrupt(bad, dataset_arrays)
    target = tmp_path / "target"

    rc = prepare_mnist.main(["--idx-dir", str(bad), "--data-dir", str(target)])

    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1, captured.err
    assert err[0].startswith("error:")
    for word in expected_words:
        assert word in err[0], (word, err[0])
    assert not target.exists()
    assert not tfds.builder(Config.dataset, data_dir=str(target)).is_prepared()


def test_prepare_refuses_a_missing_idx_dir(tmp_path, capsys):
    target = tmp_path / "target"
    rc = prepare_mnist.main(["--idx-dir", str(tmp_path / "nope"), "--data-dir", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1 and err[0].startswith("error:") and "not a directory" in err[0]
    assert not target.exists()


def test_prepare_accepts_uncompressed_idx_files(tmp_path, dataset_arrays):
    """The docstring promises gzip or raw IDX files; raw ones must prepare the same dataset."""
    raw = tmp_path / "raw"
    write_idx_dir(raw, dataset_arrays)
    for name in os.listdir(raw):
        payload = gzip.decompress((raw / name).read_bytes())
        (raw / name[:-3]).write_bytes(payload)
        os.remove(raw / name)
    target = tmp_path / "target"
    prepare_mnist.prepare(str(raw), str(target))
    builder = tfds.builder(Config.dataset, data_dir=str(target))
    assert builder.is_prepared()
    assert builder.info.splits["test"].num_examples == NUM_TEST
