"""Storage faults: a full disk gives one line and exit 2, and the same command resumes once there is room; a
damaged latest backup resumes from the one before it, and a backup with no whole checkpoint is refused untouched.

One run fills a tmpfs (root only) at its third backup (two are kept): sized from the model, room for two and a half
backups (the tutorial's model's sizes: docs/faults.md, "A full disk"). It leaves a backup of two checkpoints:
copies of it, damaged, serve the other tests.
"""

import errno
import json
import os
import pathlib
import shutil
import subprocess

import pytest

from processes import backed_up_images, run_entrypoint, skip_unless_ci

EPOCHS = 2
IMAGES = 1600  # resume_data_dir's training split
BATCH = 32
EVERY = 10  # steps between backups: 320 images
ARGS = ["--epochs", str(EPOCHS), "--batch-size-per-replica", str(BATCH), "--steps-per-execution", "5",
        "--backup-every-steps", str(EVERY)]
FULL_BACKUPS = 2.5  # the tmpfs's room, in backups: two are kept, and the third finds no room
ROOMY_BACKUPS = 16  # room for the whole run: backups, checkpoints and exports
ROOMY_BYTES = 64 * 2 ** 20  # at least: the exports and logs of a small model take more than its backups


def _backup_bytes():
    """About what one backup of model.py's model takes: its weights and Adam's two slots for each, float32."""
    import data
    import model

    return 3 * 4 * model.build_model(*data.image_shape_and_classes()).count_params()


def _mount(directory, size):
    directory.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode:
        skip_unless_ci(f"cannot mount a tmpfs: {done.stderr.strip()}")
    return directory


def _unmount(directory):
    subprocess.run(["umount", str(directory)], check=True, timeout=60)


def _args(data_dir, output_dir):
    return [*ARGS, "--data-dir", data_dir, "--output-dir", str(output_dir)]


def _lines(stderr, start):
    return [line for line in stderr.splitlines() if line.startswith(start)]


def _files(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


def _every_image_once(output_dir):
    results = json.loads((pathlib.Path(output_dir) / "results.json").read_text())
    assert results["resumed_after_images"] + results["train_images"] == EPOCHS * IMAGES
    assert not os.path.exists(os.path.join(output_dir, "backup"))
    return results


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory, resume_data_dir):
    """The run on a full disk, its output dir (the tmpfs, still as small), and two copies of what it left."""
    base = tmp_path_factory.mktemp("storage")
    mount = _mount(base / "tmpfs", int(FULL_BACKUPS * _backup_bytes()))
    try:
        run = run_entrypoint(_args(resume_data_dir, mount), base)
        copies = {name: shutil.copytree(mount, base / name) for name in ("latest_damaged", "all_damaged")}
        yield run, mount, copies
    finally:
        _unmount(mount)


@pytest.mark.slow
def test_a_full_disk_says_so_in_one_line_and_the_same_command_resumes_with_room(full_disk, resume_data_dir):
    run, mount, _ = full_disk
    assert run.returncode == 2, run.stderr[-3000:]
    errors = _lines(run.stderr, "error:")
    assert len(errors) == 1, run.stderr[-3000:]
    assert f"no space left on the file system at {mount} " in errors[0]
    assert f"writing in {mount}/backup/chief" in errors[0] and "run the same command again" in errors[0]
    assert "Traceback" not in run.stderr
    # Two backups were written before the third found no room; both are whole.
    assert backed_up_images(str(mount / "backup")) == 2 * EVERY * BATCH

    roomy = max(ROOMY_BYTES, ROOMY_BACKUPS * _backup_bytes())
    subprocess.run(["mount", "-o", f"remount,size={roomy}", str(mount)], check=True, timeout=60)
    again = run_entrypoint(_args(resume_data_dir, mount), mount.parent)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from the backup" in again.stdout
    assert _every_image_once(mount)["resumed_after_images"] == 2 * EVERY * BATCH


@pytest.mark.slow
def test_a_damaged_latest_backup_resumes_from_the_one_before(full_disk, resume_data_dir):
    _, _, copies = full_disk
    output_dir = copies["latest_damaged"]
    latest = output_dir / "backup" / "chief" / "ckpt-2.data-00000-of-00001"
    os.truncate(latest, latest.stat().st_size // 2)  # as a pre-empted machine's storage may leave it

    run = run_entrypoint(_args(resume_data_dir, output_dir), output_dir.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = _lines(run.stderr, "warning: the latest backup")
    assert warnings == [f"warning: the latest backup in {output_dir}/backup is damaged (ckpt-2: Read less bytes than "
                        f"requested); resuming from the one before it at epoch 1, image {EVERY * BATCH} of {IMAGES:,}"]
    assert not _lines(run.stderr, "error:") and "Traceback" not in run.stderr
    assert _every_image_once(output_dir)["resumed_after_images"] == EVERY * BATCH


@pytest.mark.slow
def test_a_backup_with_no_whole_checkpoint_is_refused_and_left_as_it_was(full_disk, resume_data_dir):
    _, _, copies = full_disk
    output_dir = copies["all_damaged"]
    chief = output_dir / "backup" / "chief"
    os.truncate(chief / "ckpt-2.data-00000-of-00001", 0)
    older = bytearray((chief / "ckpt-1.data-00000-of-00001").read_bytes())
    older[1000] ^= 0xFF  # one changed byte: the tensor's checksum catches it
    (chief / "ckpt-1.data-00000-of-00001").write_bytes(older)
    before = _files(output_dir)

    run = run_entrypoint(_args(resume_data_dir, output_dir), output_dir.parent)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    errors = _lines(run.stderr, "error:")
    assert len(errors) == 1 and errors[0].startswith(f"error: the backup in {output_dir}/backup is damaged"), errors
    assert "ckpt-2: Read less bytes than requested" in errors[0] and "ckpt-1: " in errors[0]
    assert "Checksum does not match" in errors[0] and "--overwrite" in errors[0]
    assert _files(output_dir) == before


def test_python_writes_on_a_full_disk_are_named_too(tmp_path):
    """results.json and model.keras are written by Python, whose OSError names no file: the line names
    --output-dir, where the run writes them."""
    import config
    from machinery import outputs

    mount = _mount(tmp_path / "tiny", "64k")
    try:
        cfg = config.Config(output_dir=str(mount))
        with pytest.raises(OSError) as raised:
            outputs.write_json(cfg.path(cfg.results_file), {"figures": "x" * 200_000})
        assert raised.value.errno == errno.ENOSPC
        line = outputs.no_space(cfg, raised.value)
        assert line.startswith(f"no space left on the file system at {mount} (")
        assert f"writing in {mount};" in line
        assert outputs.no_space(cfg, OSError(errno.EACCES, "Permission denied")) is None
    finally:
        _unmount(mount)
