"""TensorFlow 2.21's oneDNN MaxPoolGrad aborts the process on an empty batch inside a graph, on some CPUs.

Minimal reproducer, fit for an upstream report (tensorflow/tensorflow). Run: `python empty_batch_maxpoolgrad.py`.

- Expected: the gradient of a max-pool over zero examples, shape (0, 4, 4, 1), as eager execution gives, and as
  the graph gives with `TF_ENABLE_ONEDNN_OPTS=0`.
- Seen with tensorflow 2.21.0 (pip, CPU) on an AMD EPYC with AVX512_BF16, exit 134 (SIGABRT):
  `F... tensor.cc:896] Check failed: dtype() == expected_dtype (1 vs. 3) int32 expected, got float`, in
  `tensorflow::MklMaxPoolingGradOp<>::Compute()`. Another x86-64 CPU ran it to the end.
- Why it matters: under `tf.distribute`, a global batch of fewer examples than replicas leaves a replica with an
  empty batch (an epoch's short last batch), and its train step aborts the whole job, at the same step on every
  restart. mnist-mirrored pads such batches (machinery/input_engine.padded); tests/test_empty_batches.py runs this file to tell
  whether TensorFlow still needs that.
"""

import tensorflow as tf


@tf.function
def max_pool_gradient(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")
    return tape.gradient(y, x)


print(f"tensorflow {tf.__version__}: gradient of an empty batch, shape {max_pool_gradient(tf.zeros([0, 4, 4, 1])).shape}")
