"""Before: a custom loop with Horovod's DistributedGradientTape (`horovodrun -np 2 ...`)."""
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

hvd.init()
model = build_model()
optimizer = keras.optimizers.SGD(LEARNING_RATE)
weights = [v.value for v in model.trainable_variables]  # Keras 3: the tf.Variables Horovod needs
ids, labels = load_data()
dataset = (tf.data.Dataset.from_tensor_slices((ids, labels))
           .shard(hvd.size(), hvd.rank()).batch(GLOBAL_BATCH // hvd.size()))


@tf.function
def train_step(features, targets, first_batch):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(targets, model(features)))
    tape = hvd.DistributedGradientTape(tape)         # averages the gradients over workers
    grads = tape.gradient(loss, weights)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:                                  # every worker starts from rank 0's state
        hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
        hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)
    return hvd.allreduce(loss)                       # the mean over workers


for epoch in range(EPOCHS):
    losses = [train_step(x, y, epoch == 0 and step == 0) for step, (x, y) in enumerate(dataset)]
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {np.mean(losses):.6f}")
