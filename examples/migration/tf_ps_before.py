"""Before: TF's ParameterServerStrategy; this program is the coordinator (TF_CONFIG task
"chief"), the "worker" and "ps" tasks run tf.distribute.Server until killed."""
import os

os.environ["GRPC_FAIL_FAST"] = "use_caller"  # before TensorFlow starts: TF's PS tutorial

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from your_model import (EPOCHS, GLOBAL_BATCH, LEARNING_RATE, STEPS_PER_EPOCH,  # noqa: E402
                        build_model, load_data)

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(
    resolver, variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=len(resolver.cluster_spec().job_tasks("ps"))))
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():                               # variables on the ps tasks
    model = build_model()
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
ids, labels = load_data()


def dataset_fn():
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(GLOBAL_BATCH).repeat()


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


@tf.function
def train_step(iterator):
    def step_fn(features, targets):
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(targets, model(features))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.run(step_fn, args=next(iterator))


for epoch in range(EPOCHS):
    losses = [coordinator.schedule(train_step, args=(iterator,))  # to any free worker
              for _ in range(STEPS_PER_EPOCH)]
    coordinator.join()
    print(f"epoch {epoch}: loss {np.mean([loss.fetch() for loss in losses]):.6f}")
