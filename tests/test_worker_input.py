"""Each of two workers gathers only its own share of every global batch, and gets exactly the examples, and so
the gradients, that Keras's own multi-worker input path gives it, partial last batches included; and the logs
of each step are the metrics' values, all workers' together, not their sum over the workers."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from processes import ROOT, free_ports, subprocess_env
from runs import max_abs_diff

TESTS = os.path.join(ROOT, "tests")  # on the script's path, for small_data.cached_split

# Each test here starts whole training runs.
pytestmark = pytest.mark.slow

# Runs in each worker's process: a strategy needs a process of its own.
WORKER_SCRIPT = textwrap.dedent("""
    import functools, json, sys
    import numpy as np
    import tensorflow as tf
    import data
    from small_data import cached_split
    from machinery import input_engine
    from model import build_model, compile_model, keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    keras.utils.set_random_seed(1)  # as the run does, before its data
    image_shape, num_classes = data.image_shape_and_classes()  # from tfds's DatasetInfo
    rng = np.random.default_rng(0)
    PER_REPLICA = 4
    global_batch = PER_REPLICA * strategy.num_replicas_in_sync
    out = {}
    # 19 examples end each epoch with a batch of 3 (shares of 2 and 1), 17 with a batch of 1 (1 and a padding
    # example: an empty share aborts TensorFlow's oneDNN MaxPoolGrad on some CPUs).
    for num_examples in (19, 17):
        images = rng.integers(0, 256, (num_examples, *image_shape), dtype=np.uint8)
        labels = rng.integers(0, num_classes, num_examples).astype(np.int64)
        steps = input_engine.steps_per_epoch(num_examples, global_batch)
        stream = input_engine.Stream(num_examples=num_examples, global_batch=global_batch, buffer_size=8, seed=3, epochs=2)
        make_dataset = functools.partial(input_engine.train_batches, cached_split(images, labels), stream,
                                         pad_to=strategy.num_replicas_in_sync)
        paths = {"project": input_engine.distribute(strategy, make_dataset),
                 "keras": strategy.experimental_distribute_dataset(make_dataset(share=input_engine.WHOLE))}

        def labels_seen(distributed):  # each step's labels on this worker, and their weights
            iterator = iter(distributed)
            local = lambda values: strategy.experimental_local_results(values)[0].numpy().tolist()
            return [[local(part) for part in next(iterator)[1:]] for _ in range(2 * steps)]

        with strategy.scope():
            initial = build_model(image_shape, num_classes).get_weights()
        for name, distributed in paths.items():
            out[f"labels_{name}_{num_examples}"] = labels_seen(distributed)
            with strategy.scope():
                model = build_model(image_shape, num_classes)
                model.set_weights(initial)
                model.compile(optimizer=keras.optimizers.SGD(0.5),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            # Keras's path is handed the plain dataset, as `fit` gets it from users.
            model.fit(make_dataset(share=input_engine.WHOLE) if name == "keras" else distributed, epochs=2,
                      steps_per_epoch=steps, verbose=0)
            out[f"weights_{name}_{num_examples}"] = [w.tolist() for w in model.get_weights()]
        out[f"initial_{num_examples}"] = [w.tolist() for w in initial]

    # The project's compile: the logs of an epoch's last step (what the progress bar and batch-level callbacks
    # show) against the epoch's own figures, which Keras recomputes from the metrics.
    with strategy.scope():
        model = compile_model(build_model(image_shape, num_classes), steps_per_execution=steps)
    seen = []
    logs_seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(dict(logs)))
    history = model.fit(paths["project"], epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[logs_seen])
    out["step_logs"], out["epoch_logs"] = seen[-1], {k: v[-1] for k, v in history.history.items()}
    json.dump(out, open(sys.argv[1], "w"))
""")


def test_two_workers_get_keras_shares_and_gradients(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    procs = []
    for index in range(2):
        env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
               "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, str(tmp_path / f"w{index}.json")], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        errors = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, stderr in zip(procs, errors):
        assert proc.returncode == 0, stderr[-3000:]
    workers = [json.loads((tmp_path / f"w{index}.json").read_text()) for index in range(2)]

    for num_examples, last_shares in ((19, [2, 1]), (17, [1, 0])):
        steps = -(-num_examples // 8)
        for w in workers:
            # Step by step, the same examples and weights as Keras's rebatching gives this worker, over two epochs.
            assert w[f"labels_project_{num_examples}"] == w[f"labels_keras_{num_examples}"]
        # The workers' shares make up each global batch: 4 and 4, then the short last batch split first-heavy;
        # no share is ever empty: one that would be holds one padding example, of weight 0.
        for step in range(2 * steps):
            real = [sum(w[f"labels_project_{num_examples}"][step][1]) for w in workers]
            sizes = [len(w[f"labels_project_{num_examples}"][step][1]) for w in workers]
            assert real == ([4, 4] if step % steps < steps - 1 else last_shares)
            assert sizes == [max(n, 1) for n in real]
        # The same gradients, so the same weights after two epochs of SGD (partial batches included), on both.
        moved = max_abs_diff(workers[0][f"initial_{num_examples}"], workers[0][f"weights_keras_{num_examples}"])
        assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
        for w in workers:
            assert max_abs_diff(w[f"weights_project_{num_examples}"], w[f"weights_keras_{num_examples}"]) < 1e-6
    # Step logs are the metrics as they are, not summed over the two workers (Keras's default doubled them).
    for w in workers:
        assert set(w["step_logs"]) == {"loss", "accuracy"}
        for name, value in w["epoch_logs"].items():
            assert abs(w["step_logs"][name] - value) < 1e-6 * max(1.0, abs(value)), (name, w["step_logs"], value)


def test_the_entrypoint_keeps_cpu_memory_in_tensorflows_allocator():
    """Set before TensorFlow starts (it reads it once, for its first CPU device); a user's own setting wins."""
    check = "import os, train_mnist_mirrored; print(os.environ['TF_CPU_ALLOCATOR_USE_BFC'])"
    for given, expected in ((None, "true"), ("false", "false")):
        env = {**subprocess_env(), "PYTHONPATH": ROOT}
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        if given:
            env["TF_CPU_ALLOCATOR_USE_BFC"] = given
        proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr[-2000:]
