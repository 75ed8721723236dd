"""After: ParallaxStrategy; every worker runs this program and there is no coordinator
(`parallax run -np 2 tf_ps_after.py`, or one worker with TF_CONFIG's "ps" tasks)."""
import keras
import numpy as np
import tensorflow as tf

import parallax
from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

strategy = parallax.ParallaxStrategy()  # mode="ps", sync=False: closest to TF's PS (see below)
with strategy.scope():
    model = build_model()
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
ids, labels = load_data()


def dataset_fn(context):                             # each worker's part of every batch
    return (tf.data.Dataset.from_tensor_slices((ids, labels))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(context.get_per_replica_batch_size(GLOBAL_BATCH)))


dataset = strategy.distribute_datasets_from_function(dataset_fn)


@tf.function
def train_step(features, targets):
    def step_fn(features, targets):
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(targets, model(features))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    per_worker = strategy.run(step_fn, args=(features, targets))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_worker, axis=None)


for epoch in range(EPOCHS):
    losses = [train_step(x, y) for x, y in dataset]  # one synchronous step per global batch
    if strategy.worker.is_chief:
        print(f"epoch {epoch}: loss {np.mean(losses):.6f}")
if strategy.worker.is_chief:
    with strategy.local_tables():                    # the tables' rows, in this process
        model.export("exported_model", verbose=False)  # a SavedModel that serves alone
