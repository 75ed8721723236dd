"""After: the same `fit` under ParallaxStrategy (`parallax run -np 2 horovod_keras_after.py`)."""
import keras
import tensorflow as tf

import parallax
from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

strategy = parallax.ParallaxStrategy()
with strategy.scope():
    model = build_model()
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
ids, labels = load_data()
dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(GLOBAL_BATCH)  # global
callbacks = []
if strategy.worker.is_chief:
    callbacks.append(keras.callbacks.ModelCheckpoint("checkpoint.weights.h5",
                                                     save_weights_only=True))
history = model.fit(dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)
if strategy.worker.is_chief:
    for epoch, loss in enumerate(history.history["loss"]):
        print(f"epoch {epoch}: loss {loss:.6f}")
