"""One scratch folder per process under the temp dir (TMPDIR), holding every temporary file the process makes, and
removed at every end (docs/faults.md, "Nothing left behind").

What lands there: autograph's generated sources (TensorFlow removes them only from an exit handler, which a
process that ends early never runs), the empty folder tfds's builder makes when it looks for MNIST's metadata
offline, and a non-chief worker's own output folder (outputs.clear_and_make_work_dir). All of them use Python's
`tempfile`, whose folder is set here; TMPDIR is set too, for TensorFlow's C++ code.

The folder's name comes from what the process works on (the output folder and the worker's rank), so a process
killed outright (SIGKILL) leaves it to the same command's restart, which empties it first. The restart knows the
old one is gone by a lock on a file inside (the kernel's, released whatever ends the holder); while another live
process holds it, this one takes a folder of its own.
"""

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile

PREFIX = "mnist-scratch-"
LOCK = ".lock"

_current = None  # this process's folder while `kept` runs


def name(key):
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]


def _taken(path):
    """Locks `path`'s lock file, emptied of what a dead process left; None when a live process holds it."""
    os.makedirs(path, exist_ok=True)
    lock = open(os.path.join(path, LOCK), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        elif entry.name != LOCK:
            os.remove(entry.path)
    return lock


@contextlib.contextmanager
def kept(key):
    """Makes this process's scratch folder, named from `key`, the temp dir of Python and TensorFlow until the block
    ends, then removes it; sigterm.end_process removes it when the process ends inside the block."""
    global _current
    previous, environ_tmpdir = tempfile.tempdir, os.environ.get("TMPDIR")
    path = os.path.join(tempfile.gettempdir(), name(key))
    lock = _taken(path)
    if lock is None:
        path = tempfile.mkdtemp(prefix=PREFIX)
    tempfile.tempdir, os.environ["TMPDIR"], _current = path, path, path
    try:
        yield path
    finally:
        tempfile.tempdir, _current = previous, None
        if environ_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = environ_tmpdir
        remove(path)
        if lock is not None:
            lock.close()


def remove(path=None):
    """Removes `path`, by default this process's scratch folder (if any)."""
    path = path or _current
    if path:
        shutil.rmtree(path, ignore_errors=True)
