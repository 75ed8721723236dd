"""Before: Keras `fit` with Horovod's DistributedOptimizer (`horovodrun -np 2 ...`)."""
import horovod.tensorflow.keras as hvd
import keras
import tensorflow as tf

from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

hvd.init()
model = build_model()
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE)),
              loss="mse")
ids, labels = load_data()
dataset = (tf.data.Dataset.from_tensor_slices((ids, labels))
           .shard(hvd.size(), hvd.rank()).batch(GLOBAL_BATCH // hvd.size()))
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint("checkpoint.weights.h5",
                                                     save_weights_only=True))
history = model.fit(dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    for epoch, loss in enumerate(history.history["loss"]):
        print(f"epoch {epoch}: loss {loss:.6f}")
