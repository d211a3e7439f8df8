"""Tutorial step 6: export a SavedModel, reload it without and with the strategy's scope, evaluate both.

Beside it goes `model.keras`, the file today's Keras 3 tutorial exports, for Keras 3 users.
"""

import contextlib
import json
import os
import shutil
import zipfile

from machinery import tf_private
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
    """The trained model in the `.keras` format, which Keras 3's `keras.saving.load_model` reads.

    Saved uncompiled: Keras 3 cannot rebuild tf_keras's compiled optimizer (neither `legacy.Adam` nor the
    arguments tf_keras's `Adam` config carries), so a Keras 3 user compiles it after loading, as the
    tutorial compiles its reloaded model. Written under a temporary name, then renamed into place; Keras
    insists that the name end in `.keras`.
    """
    base, suffix = os.path.splitext(path)
    partial = base + ".partial" + suffix
    plain = keras.models.clone_model(model)
    plain.set_weights(model.get_weights())
    plain.save(partial)
    _name_the_policies(partial)
    os.replace(partial, path)


# Inside a `.keras` file (a zip): the model's architecture, where each layer's `dtype` is its policy.
KERAS_CONFIG = "config.json"


def _policy_names(node):
    """`node` with each serialized mixed-precision policy replaced by its name ("mixed_bfloat16")."""
    if isinstance(node, list):
        return [_policy_names(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("class_name") == "Policy" and set(node.get("config", ())) == {"name"}:
        return node["config"]["name"]
    return {key: _policy_names(value) for key, value in node.items()}


def _name_the_policies(path):
    """tf_keras writes a mixed-precision policy as its class, `Policy` from `keras.mixed_precision`, which Keras 3's
    loader does not find (it fails with "'str' object has no attribute 'quantization_mode'"); both read a
    policy's name, as they read "float32" under the default policy. Rewrites the file's architecture so."""
    with zipfile.ZipFile(path) as archive:
        entries = {info: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for info, content in entries.items():
            if info.filename == KERAS_CONFIG:
                content = json.dumps(_policy_names(json.loads(content))).encode()
            archive.writestr(info, content)


def reload(path, strategy=None, *, steps_per_execution=1):
    """TF 2.0's `tf.keras.experimental.load_from_saved_model` is `keras.models.load_model` now.

    Reloaded inside `strategy.scope()` when a strategy is given, then compiled as the tutorial does, running
    `steps_per_execution` test steps a call as the trained model does. The metrics' totals are made now, so that
    `evaluate` traces its step once, not twice.
    """
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = compile_model(keras.models.load_model(path, compile=False), steps_per_execution=steps_per_execution)
    tf_private.create_step_variables(model)
    return model
