"""Tutorial step 3: the CNN, built and compiled inside the strategy's scope by the caller.

Keras is imported here and nowhere else. The project uses `tf_keras` (Keras 2) because Keras 3's `fit`
fails under MultiWorkerMirroredStrategy (keras-team/keras#20585); moving to Keras 3 once that is fixed is
this one line.
"""

import tensorflow as tf
import tf_keras as keras


def use_mixed_precision(policy):
    """Keras's mixed-precision `policy` (config.Config.dtype_policy), set before the model is built (its layers take
    the global policy then): float32 weights, float16 or bfloat16 compute.

    Under mixed_float16 `compile` then wraps the optimizer in a LossScaleOptimizer, so small float16 gradients do
    not vanish; bfloat16 has float32's range and needs none.
    """
    keras.mixed_precision.set_global_policy(policy)


def build_model(image_shape, num_classes):
    """The tutorial's CNN, for images of `image_shape` (height, width, channels) in `num_classes` classes: what
    data.scale yields and the dataset's classes (data.model_input)."""
    return keras.Sequential([
        keras.Input(shape=image_shape),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        # float32 even under mixed precision, as Keras's guide says: the logits, the loss and the exported
        # model's outputs stay float32. Under the default float32 policy it changes nothing.
        keras.layers.Dense(num_classes, dtype="float32"),
    ])


def all_reduce_in(dtype):
    """A gradient aggregator for Keras's (legacy) optimizers that sums the replicas' gradients in `dtype`: cast
    before the all-reduce, back to each variable's type after it, so the update and the weights stay float32.

    Horovod (`hvd.Compression.fp16`) and PyTorch DDP (`bf16_compress_hook`) do the same; TensorFlow's
    CommunicationOptions has no such setting. The sum of two workers' bfloat16 gradients keeps bfloat16's 8 bits
    of mantissa: a relative rounding of at most 2**-9 on each gradient, far below Adam's own noise."""
    def aggregate(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        sent = [tf.cast(grad, dtype) for grad, _ in grads_and_vars]
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
        return [(tf.cast(total, var.dtype), var) for total, (_, var) in zip(summed, grads_and_vars)]

    return aggregate


def compile_model(model, *, steps_per_execution=1, jit_compile=False, fused_adam=False, learning_rate=None,
                  allreduce_dtype="float32"):
    """The tutorial's compile: Adam, sparse categorical cross-entropy on logits, accuracy.

    `learning_rate` (a value or a schedule) replaces Adam's default, the tutorial's 1e-3.

    `fused_adam` picks Keras's `legacy.Adam`, which applies the same Adam update (same defaults, same
    formula) with TensorFlow's fused ResourceApplyAdam kernel, one op per variable instead of about ten.

    `allreduce_dtype`: the type the gradients are all-reduced in (`all_reduce_in`), with the fused Adam only.
    """
    adam = keras.optimizers.legacy.Adam if fused_adam else keras.optimizers.Adam
    options = {} if learning_rate is None else {"learning_rate": learning_rate}
    if allreduce_dtype != "float32":
        options["gradient_aggregator"] = all_reduce_in(allreduce_dtype)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=adam(**options),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
    )
    # What the progress bar shows mid-epoch: Keras's default ("auto") sums each replica's figures across the
    # workers of a MultiWorkerMirroredStrategy, but every replica already holds the all-reduced figures, so the
    # bar showed them times the number of workers (an accuracy above 1 with two) until the epoch's end, which
    # reads the metrics themselves. "first" shows them once, and saves two all-reduces a step; with one worker it
    # changes nothing.
    model.distribute_reduction_method = "first"
    return model
