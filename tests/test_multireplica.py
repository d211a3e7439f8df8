"""Real cross-replica training: two logical CPU replicas average gradients (with each all-reduce that runs on
CPUs, and the gradients all-reduced in 16 bits). Two workers over TF_CONFIG, all-reducing in bfloat16, are
test_cluster_start.py's shared run."""

import json
import subprocess
import sys
import textwrap

import pytest

from processes import ROOT, subprocess_env
from runs import max_abs_diff

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

# Runs in its own process: logical devices can only be set before TensorFlow's runtime starts.
ONE_STEP_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    from config import Config
    from data import image_shape_and_classes
    from model import build_model, keras
    from train_mnist_mirrored import make_strategy

    two = make_strategy(Config(cpu_replicas=2), tf)      # the project's own --cpu-replicas 2 path
    one = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert two.num_replicas_in_sync == 2 and one.num_replicas_in_sync == 1
    # --cross-device-ops on the same two logical CPUs (the devices exist now, so name them).
    two_by = {name: make_strategy(Config(devices="/cpu:0,/cpu:1", cross_device_ops=name), tf)
              for name in ("reduce-to-one", "hierarchical-copy")}
    assert type(two_by["reduce-to-one"].extended._cross_device_ops).__name__ == "ReductionToOneDevice"
    assert type(two_by["hierarchical-copy"].extended._cross_device_ops).__name__ == "HierarchicalCopyAllReduce"

    image_shape, num_classes = image_shape_and_classes()  # from tfds's DatasetInfo
    rng = np.random.default_rng(0)
    x = rng.random((32, *image_shape), dtype=np.float32)
    y = rng.integers(0, num_classes, 32)
    keras.utils.set_random_seed(0)
    initial = build_model(image_shape, num_classes).get_weights()

    def one_step(strategy, optimizer, learning_rate):
        with strategy.scope():
            model = build_model(image_shape, num_classes)
            model.set_weights(initial)
            model.compile(optimizer=optimizer(learning_rate),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0, shuffle=False)
        return [w.tolist() for w in model.get_weights()]

    out = {
        "initial": [w.tolist() for w in initial],
        "sgd_one": one_step(one, keras.optimizers.SGD, 0.5),
        "sgd_two": one_step(two, keras.optimizers.SGD, 0.5),
        "sgd_one_double_rate": one_step(one, keras.optimizers.SGD, 1.0),
        "adam_one": one_step(one, keras.optimizers.Adam, 1e-3),
        "adam_two": one_step(two, keras.optimizers.Adam, 1e-3),
        **{f"sgd_two_{name}": one_step(strategy, keras.optimizers.SGD, 0.5) for name, strategy in two_by.items()},
    }

    # --allreduce-dtype's aggregator on two replicas: each replica's gradient cast, summed in that type, cast back.
    from model import all_reduce_in
    grads = rng.standard_normal((2, 3, 5)).astype(np.float32)
    with two.scope():
        var = tf.Variable(tf.zeros((3, 5)))

    def summed(dtype):
        def on_replica():
            grad = tf.gather(tf.constant(grads), tf.distribute.get_replica_context().replica_id_in_sync_group)
            (total, variable), = all_reduce_in(dtype)([(grad, var)])
            assert variable is var and total.dtype == tf.float32
            return total
        return two.experimental_local_results(two.run(on_replica))[0].numpy().tolist()

    out["allreduce"] = {dtype: summed(dtype) for dtype in ("float32", "bfloat16", "float16")}
    out["allreduce_expected"] = {
        dtype: tf.cast(tf.cast(grads[0], dtype) + tf.cast(grads[1], dtype), tf.float32).numpy().tolist()
        for dtype in ("float32", "bfloat16", "float16")}
    json.dump(out, open(sys.argv[1], "w"))
""")


def test_two_replicas_average_gradients_like_one(tmp_path):
    out = tmp_path / "weights.json"
    proc = subprocess.run([sys.executable, "-c", ONE_STEP_SCRIPT, str(out)], cwd=ROOT, env={**subprocess_env(), "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = json.loads(out.read_text())
    moved = max_abs_diff(w["initial"], w["sgd_one"])
    assert moved > 1e-3, "the step must change the weights for the comparison to mean anything"
    # Same global batch, split over two replicas: averaged gradients give the one-replica update...
    assert max_abs_diff(w["sgd_one"], w["sgd_two"]) < 1e-5 * max(1.0, moved) + 1e-6
    # ...while summed gradients would equal a one-replica step at twice the rate, which is far away.
    assert max_abs_diff(w["sgd_two"], w["sgd_one_double_rate"]) > 100 * max_abs_diff(w["sgd_one"], w["sgd_two"])
    assert max_abs_diff(w["adam_one"], w["adam_two"]) < 1e-5
    # Each all-reduce that runs on CPUs gives TensorFlow's default step.
    for name in ("reduce-to-one", "hierarchical-copy"):
        assert max_abs_diff(w["sgd_two"], w[f"sgd_two_{name}"]) < 1e-5, name
    # --allreduce-dtype: the sum is the sum of the gradients cast to that type, back in float32; in 16 bits it
    # differs from float32's by the rounding, and only by that.
    for dtype, expected in w["allreduce_expected"].items():
        assert w["allreduce"][dtype] == expected, dtype
    assert 0 < max_abs_diff([w["allreduce"]["bfloat16"]], [w["allreduce"]["float32"]]) < 0.05
