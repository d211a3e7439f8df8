"""Tutorial step 6: export a SavedModel, reload it without and with the strategy's scope, evaluate both.

Beside it goes `model.keras`, the file today's Keras 3 tutorial exports, for Keras 3 users.
"""

import os
import shutil

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
    os.replace(partial, path)


def reload(path, strategy=None):
    """TF 2.0's `tf.keras.experimental.load_from_saved_model` is `keras.models.load_model` now.

    Reloaded inside `strategy.scope()` when a strategy is given, then compiled as the tutorial does. The metrics'
    totals are made now, so that `evaluate` traces its step once, not twice.
    """
    if strategy is None:
        model = compile_model(keras.models.load_model(path, compile=False))
    else:
        with strategy.scope():
            model = compile_model(keras.models.load_model(path, compile=False))
    tf_private.create_step_variables(model)
    return model
