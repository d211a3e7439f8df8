"""What a newcomer meets on a first run: a clean `git status` after a run in the repository's root, `--help`'s
defaults, the printed learning rate, and the offline prepare's own lines."""

import dataclasses
import os
import shutil
import subprocess

import pytest

from config import Config
from processes import ROOT


# ---------------------------------------------------------------- a run in the repository's root

def written_beside(field, name):
    """What export.py and outputs.write_json write beside an output while writing it, then move into place."""
    stem, extension = os.path.splitext(name)
    return {"saved_model_dir": [name + ".partial", name + ".old"], "results_file": [name + ".partial"],
            "keras_model_file": [stem + ".partial" + extension]}.get(field, [])


def test_gitignore_covers_every_output_of_a_run_in_the_root(tmp_path):
    """Every output Config names (a `*_dir` or `*_file` that is no option), and what is written beside it, made
    in a fresh repository holding only the project's .gitignore: git sees nothing but the .gitignore."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    subprocess.run([git, "init", "-q", str(tmp_path)], check=True, timeout=60)
    shutil.copy(f"{ROOT}/.gitignore", tmp_path / ".gitignore")
    outputs = [f for f in dataclasses.fields(Config) if "help" not in f.metadata and f.name.endswith(("_dir", "_file"))]
    assert {f.name for f in outputs} >= {"checkpoint_dir", "log_dir", "saved_model_dir", "backup_dir",
                                         "keras_model_file", "results_file"}
    for field in outputs:
        for name in [field.default, *written_beside(field.name, field.default)]:
            if field.name.endswith("_dir"):
                (tmp_path / name).mkdir()
                (tmp_path / name / "content").write_text("x")
            else:
                (tmp_path / name).write_text("x")
    status = subprocess.run([git, "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert status.splitlines() == ["?? .gitignore"]


# ---------------------------------------------------------------- --help

def test_help_says_what_an_unset_option_means_never_default_none(capsys):
    """argparse's "(default: None)" would contradict help texts that name the real default (--communication:
    auto; --data-dir: tfds's own); an option that can be left unset says what that means instead."""
    import re

    import train_mnist_mirrored

    with pytest.raises(SystemExit):
        train_mnist_mirrored.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help texts
    assert "(default: None)" not in shown
    assert "--epochs EPOCHS number of epochs to train (default: 12)" in shown  # other defaults still shown
    unset = [f for f in dataclasses.fields(Config) if "help" in f.metadata and f.default is None]
    assert {"communication", "devices", "data_dir", "steps_per_epoch"} <= {f.name for f in unset}
    for field in unset:
        assert re.search(r"\bunset\b", field.metadata["help"]), field.name


# ---------------------------------------------------------------- the printed learning rate

@pytest.mark.parametrize("rate, shown", [(None, "0.001"), (1e-4, "1e-04"), (2e-3 * 0.75, "0.0015")],
                         ids=["adam-default", "decayed", "warm-up"])
def test_learning_rate_prints_as_the_float32_it_is(rate, shown, capsys):
    """The optimizer holds a float32; printed as a Python float it read 0.0010000000474974513."""
    import callbacks
    import data
    import model

    net = model.compile_model(model.build_model(*data.image_shape_and_classes()), learning_rate=rate)
    printer = callbacks.PrintLR()
    printer.set_model(net)
    printer.on_epoch_end(0)
    assert capsys.readouterr().out == f"\nLearning rate for epoch 1 is {shown}\n"


# ---------------------------------------------------------------- the offline prepare

def test_offline_mnist_prepare_says_what_it_does_and_nothing_else(tmp_path, idx_dir, capfd, caplog):
    """The first offline run (`--idx-dir DIR --data-dir NEW`) printed tfds's warning that the dataset folder it
    had not made yet "has no dataset_info.json", twice, and "Downloading and preparing dataset Unknown size"."""
    import data
    from small_data import NUM_TRAIN

    target = tmp_path / "tfds"
    info = data.load("mnist", str(target), idx_dir)
    out, err = capfd.readouterr()
    assert info.splits["train"].num_examples == NUM_TRAIN
    assert "dataset_info.json" not in out + err + caplog.text  # absl's warnings reach pytest as log records
    assert "Downloading" not in out + err and "downloaded" not in out + err
    assert f"preparing mnist in {target} from the IDX files in {idx_dir}\n" in out
    assert f"prepared mnist in {target / 'mnist' / '3.0.1'}\n" in out
