"""The layers point one way: the top-level modules, the tutorial's steps, call the machinery below them, and
nothing in machinery/ imports a top-level module."""

import ast
import os

from processes import ROOT

MACHINERY = os.path.join(ROOT, "machinery")


def top_level_modules():
    return {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}


def imported(path):
    """Every module name an `import` or `from ... import` in the file names, at any depth of the code."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def test_machinery_imports_no_top_level_module():
    top = top_level_modules()
    assert {"config", "data", "model", "callbacks", "export", "train_mnist_mirrored"} <= top
    upward = {name: sorted(set(imported(os.path.join(MACHINERY, name))) & top)
              for name in sorted(os.listdir(MACHINERY)) if name.endswith(".py")}
    assert {name: modules for name, modules in upward.items() if modules} == {}


def test_the_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "upward.py"
    path.write_text("def f():\n    from model import keras\n    import data.sub\n")
    assert set(imported(str(path))) & top_level_modules() == {"model", "data"}
