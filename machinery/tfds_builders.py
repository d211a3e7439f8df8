"""tfds's builders, found and prepared without the network, for any dataset name.

A registered tfds dataset (mnist, fashion_mnist, cifar10, ...) is read through its own builder class; a name tfds
does not know is read from a data dir where it was prepared (tfds's read-only builder). `write_prepared` writes
arrays in memory as a prepared dataset: under a registered name with that dataset's own features, version and file
names, so that `tfds.load(name, data_dir=DIR)` reads them as if tfds had downloaded them; under any other name with
an image and a label feature of the arrays' shape.
"""

import contextlib
import fcntl
import os
import socket
import sys
import tempfile
import threading

import numpy as np
import tensorflow_datasets as tfds

from machinery import tf_private
from machinery.exits import UsageError

# Where tfds downloads its datasets from, and how long a run waits to learn that it cannot reach it.
DOWNLOAD_HOST = ("storage.googleapis.com", 443)
ONLINE_PROBE_SECONDS = 3
LOCK = ".prepare.lock"  # in the data dir; tfds ignores it
# The features the run trains on: tfds's supervised image classification datasets name them so.
IMAGE, LABEL = "image", "label"
UNREGISTERED_VERSION = "1.0.0"


def online():
    """True when tfds's download host answers within a few seconds (DNS included)."""
    result = []

    def probe():
        try:
            socket.create_connection(DOWNLOAD_HOST, timeout=ONLINE_PROBE_SECONDS).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(ONLINE_PROBE_SECONDS)
    return bool(result)


def made_tidily(make, *args, **kwargs):
    """`make(*args, **kwargs)`, a tfds builder, made with a temp dir of its own, removed afterwards: a builder that
    finds no prepared data makes an empty folder in the temp dir (it looks there for tfds's published metadata) and
    leaves it behind."""
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="tfds-builder-") as own:
        tempfile.tempdir = own
        try:
            return make(*args, **kwargs)
        finally:
            tempfile.tempdir = previous


def registered(name):
    """tfds's builder class for `name`, or None when tfds has no dataset of that name."""
    try:
        return tfds.builder_cls(name)
    except tfds.core.DatasetNotFoundError:
        return None


def builder(name, data_dir=None):
    """tfds's builder of `name` in `data_dir` (tfds's own data dir when None): its registered class, or for a name
    tfds does not know, the dataset prepared there. UsageError when it is neither."""
    if registered(name) is None and not prepared_somewhere(name, data_dir):
        where = data_dir or "tfds's data dir"
        raise UsageError(f"--dataset {name} is no tfds dataset and {where} holds none of that name; check the name "
                         "against tfds's catalog, or prepare it into --data-dir")
    return made_tidily(tfds.builder, name, data_dir=data_dir)


def prepared_somewhere(name, data_dir):
    """True when `data_dir` (or tfds's own) holds a prepared dataset of `name`, in any version."""
    root = os.path.join(data_dir or tfds.core.constants.DATA_DIR, name)
    return os.path.isdir(root) and any(os.path.isfile(os.path.join(root, version, "dataset_info.json"))
                                       for version in os.listdir(root))


def is_prepared(built):
    """built.is_prepared(), without its warning that a dataset folder not yet made "has no dataset_info.json" (a
    first offline run printed it twice); a folder that exists without that file still warns."""
    return built.data_path.exists() and built.is_prepared()


def declared_info(name):
    """The DatasetInfo `name`'s builder declares, with no data: its features, so its image shape and classes."""
    return made_tidily(tfds.builder, name).info


@contextlib.contextmanager
def prepare_lock(data_dir, name):
    """Runs started together on one (shared) data dir take turns to prepare it: one writes, the others wait."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, LOCK)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process preparing {name} in {data_dir} (it holds {path})", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


def image_features(image_shape, num_classes):
    """An image classification dataset's features, as tfds's own image datasets declare them."""
    return tfds.features.FeaturesDict({IMAGE: tfds.features.Image(shape=tuple(image_shape)),
                                       LABEL: tfds.features.ClassLabel(num_classes=num_classes)})


def blank(feature, index):
    """A value for a feature the arrays do not hold (cifar10's `id`, say): the example's index as text, or zeros."""
    if feature.np_dtype == object:
        return str(index)
    return np.zeros(feature.shape, feature.np_dtype)


def arrays_builder(name, splits, *, features=None):
    """A builder class that prepares `splits` ({split: (images, labels)}, uint8 images of shape (N, height, width,
    channels)) as the dataset `name`. A registered name keeps its own class, features and version; another takes
    `features`, or an image and a label feature of the arrays' shape and labels."""
    base = registered(name)
    if base is None:
        images, _ = next(iter(splits.values()))
        num_classes = max(int(np.max(labels)) for _, labels in splits.values()) + 1
        features = features or image_features(images.shape[1:], num_classes)

        class Unregistered(tfds.core.GeneratorBasedBuilder, skip_registration=True):
            VERSION = tfds.core.Version(UNREGISTERED_VERSION)

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=features, supervised_keys=(IMAGE, LABEL))

        base = Unregistered

    class FromArrays(base, skip_registration=True):
        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(*arrays) for split, arrays in splits.items()}

        def _generate_examples(self, images, labels):
            others = {key: feature for key, feature in self.info.features.items() if key not in (IMAGE, LABEL)}
            for index, (image, label) in enumerate(zip(images, labels)):
                yield index, {IMAGE: image, LABEL: int(label),
                              **{key: blank(feature, index) for key, feature in others.items()}}

    FromArrays.name = name
    return FromArrays


def write_prepared(name, splits, data_dir=None, *, exist_ok=False, features=None, source=""):
    """Writes `splits` as a prepared tfds dataset `name` under `data_dir` (arrays_builder); returns its path. `source`
    says where the arrays came from, in the line that says what is being prepared.

    tfds writes into an "incomplete" temporary folder and renames it when done, so a killed prepare leaves no
    half-written dataset behind. With `exist_ok`, a dataset another process prepared meanwhile is simply used.
    """
    root = data_dir or tfds.core.constants.DATA_DIR
    with prepare_lock(root, name):
        # Made under the lock, so that it sees what a prepare that held the lock before wrote.
        built = tf_private.without_prepare_lines(made_tidily(arrays_builder(name, splits, features=features),
                                                             data_dir=data_dir))
        if is_prepared(built):
            if exist_ok:
                return built.data_dir
            raise UsageError(f"{built.data_dir} already holds a prepared {name}; remove it first to prepare it again")
        print(f"preparing {name} in {root}{source}", flush=True)
        try:
            built.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        except BaseException:
            # tfds's progress bar, stopped mid-way, leaves its line open: what follows starts on a line of its own.
            print(file=sys.stderr, flush=True)
            raise
        print(f"prepared {name} in {built.data_dir}", flush=True)
    return built.data_dir
