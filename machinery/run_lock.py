"""One run per output folder: the run that writes --output-dir (on multi-worker, the chief) holds a lock on a file
there from its start to its end, so that a second run into the same folder stops at once, naming the first.

The lock is the kernel's (flock): whatever ends the holder, even SIGKILL, the kernel releases it, so a restart is
never blocked by a dead run. The file tells who holds it: host, process id and start time; the holder removes it as
it ends, so that only a run killed outright leaves it behind. A file system that keeps no locks gets one warning, and the run goes ahead unguarded (docs/faults.md, "One run
per folder").
"""

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time

from machinery.exits import UsageError

# What flock raises where the file system keeps no locks: NFS without its lock service (ENOLCK), Lustre mounted
# without `flock` (ENOSYS), and others (EOPNOTSUPP).
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
# A lock won on a file its holder removed as it ended is taken again on the new file, at most this often.
ATTEMPTS = 5

_held = None


class _Held:
    def __init__(self, fd, path, created):
        self.fd, self.path, self.created = fd, path, created


def _missing_folders(path):
    """The folders on the way to `path` (itself included) that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def holder(path):
    """Who holds the lock at `path`, in words, from what it wrote there."""
    try:
        with open(path) as f:
            who = json.load(f)
        return f"host {who['host']}, process id {who['pid']}, started {who['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a run that has not yet said who it is"


def take(cfg):
    """Locks cfg.output_dir for this process until it ends, or raises UsageError naming the run that holds it."""
    global _held
    path = cfg.path(cfg.lock_file)
    created = _missing_folders(cfg.output_dir)
    os.makedirs(cfg.output_dir, exist_ok=True)
    for _ in range(ATTEMPTS):
        existed = os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in UNSUPPORTED:
                if not existed:
                    os.remove(path)  # it would say nothing true
                print(f"warning: the file system of {cfg.output_dir} keeps no file locks ({err.strerror}), so a "
                      "second run into this folder would not be stopped; run one at a time there (docs/faults.md, "
                      "\"One run per folder\")", file=sys.stderr)
                return
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise UsageError(f"{cfg.output_dir} is in use by another run ({holder(path)}); wait for it to end "
                             "or stop it, or choose another --output-dir") from None
        # The run that held it may have removed the file between our open and our lock: lock the one now there.
        try:
            if os.path.samestat(os.stat(path), os.fstat(fd)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    else:
        raise UsageError(f"could not lock {path}: it keeps being removed; stop whatever removes it, then run again")
    who = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (who + "\n").encode(), 0)
    _held = _Held(fd, path, created)
    atexit.register(release)


def release():
    """Removes the lock's file and lets the lock go, so that a run leaves only its outputs; where it made the folder
    and wrote nothing else there, the folder goes too, leaving the disk as the run found it. (Only a run killed
    outright leaves the file behind, which blocks nobody.)"""
    global _held
    held, _held = _held, None
    if held is None:
        return
    atexit.unregister(release)
    try:
        # Removed while still held: a run that opened it meanwhile is refused, or finds it gone and tries again.
        if os.path.samestat(os.stat(held.path), os.fstat(held.fd)):
            os.remove(held.path)
        for folder in held.created:
            os.rmdir(folder)
    except OSError:
        pass  # the file was replaced, or the folder holds outputs: leave them
    finally:
        os.close(held.fd)
