"""Tutorial step 6: export a SavedModel, reload it without and with the strategy's scope, evaluate both.

Beside it goes `model.keras`, the file today's Keras 3 tutorial exports, for Keras 3 users.
"""

import contextlib
import json
import os
import shutil
import zipfile

from model import compile_model, keras


def replace_dir(src, dst):
    """Moves the finished folder src to dst, so dst is never a half-written folder."""
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def export(model, path):
    """TF 2.0's `tf.keras.experimental.export_saved_model` is `model.save` in the SavedModel format now.

    The SavedModel carries a `serving_default` signature, so `tf.saved_model.load` serves it with no
    project code. It is written beside `path` and moved into place when complete.
    """
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save(partial, save_format="tf", include_optimizer=False)
    replace_dir(partial, path)


def export_keras(model, path):
    """The trained model in the `.keras` format, which Keras 3's `keras.saving.load_model` reads; returns None, or
    why Keras could not save this model (one line for the summary).

    Saved without its compile settings: Keras 3 cannot rebuild tf_keras's compiled optimizer (neither `legacy.Adam`
    nor the arguments tf_keras's `Adam` config carries), so a Keras 3 user compiles it after loading, as the
    tutorial compiles its reloaded model. Written under a temporary name, then renamed into place; Keras insists
    that the name end in `.keras`.
    """
    base, suffix = os.path.splitext(path)
    partial = base + ".partial" + suffix
    try:
        model.save(partial)
    except (NotImplementedError, TypeError, ValueError) as err:
        if os.path.exists(partial):
            os.remove(partial)
        return f"Keras cannot save this model as {os.path.basename(path)} ({type(err).__name__}: " \
               f"{str(err).splitlines()[0] if str(err) else 'no reason given'})"
    _for_keras_3(partial)
    os.replace(partial, path)
    return None


# Inside a `.keras` file (a zip): the model's architecture, where each layer's `dtype` is its policy.
KERAS_CONFIG = "config.json"
COMPILE_CONFIG = "compile_config"  # beside the architecture: the loss, the metrics and the optimizer


def _policy_names(node):
    """`node` with each serialized mixed-precision policy replaced by its name ("mixed_bfloat16")."""
    if isinstance(node, list):
        return [_policy_names(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("class_name") == "Policy" and set(node.get("config", ())) == {"name"}:
        return node["config"]["name"]
    return {key: _policy_names(value) for key, value in node.items()}


def _for_keras_3(path):
    """Rewrites the file's architecture for Keras 3's loader: without `compile_config` (see export_keras), and each
    mixed-precision policy by its name. tf_keras writes a policy as its class, `Policy` from `keras.mixed_precision`,
    which Keras 3's loader does not find (it fails with "'str' object has no attribute 'quantization_mode'"); both
    read a policy's name, as they read "float32" under the default policy."""
    with zipfile.ZipFile(path) as archive:
        entries = {info: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for info, content in entries.items():
            if info.filename == KERAS_CONFIG:
                architecture = _policy_names(json.loads(content))
                architecture.pop(COMPILE_CONFIG, None)
                content = json.dumps(architecture).encode()
            archive.writestr(info, content)


def reload(path, strategy=None, *, steps_per_execution=1):
    """TF 2.0's `tf.keras.experimental.load_from_saved_model` is `keras.models.load_model` now.

    Reloaded inside `strategy.scope()` when a strategy is given, then compiled as the tutorial does, running
    `steps_per_execution` test steps a call as the trained model does.
    """
    with strategy.scope() if strategy else contextlib.nullcontext():
        return compile_model(keras.models.load_model(path, compile=False), steps_per_execution=steps_per_execution)


def accuracy(model, evaluation):
    """The model's test accuracy: the first figure `evaluate` gives after the loss, on the test split's input."""
    figures = model.evaluate(evaluation.dataset, steps=evaluation.steps, return_dict=True)
    return next(value for name, value in figures.items() if name != "loss")
