"""After: the same loop under ParallaxStrategy (`parallax run -np 2 horovod_tape_after.py`)."""
import keras
import numpy as np
import tensorflow as tf

import parallax
from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

strategy = parallax.ParallaxStrategy()               # runs hvd.init() under horovodrun
with strategy.scope():                               # variables made here can be placed
    model = build_model()
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
ids, labels = load_data()
dataset = strategy.experimental_distribute_dataset(  # global batches: each worker its part
    tf.data.Dataset.from_tensor_slices((ids, labels)).batch(GLOBAL_BATCH))


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
    losses = [train_step(x, y) for x, y in dataset]
    if strategy.worker.is_chief:
        print(f"epoch {epoch}: loss {np.mean(losses):.6f}")
