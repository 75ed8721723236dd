"""Before: Keras `fit` under MultiWorkerMirroredStrategy (each worker's TF_CONFIG names it)."""
import keras
import tensorflow as tf

from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = build_model()
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
ids, labels = load_data()
history = model.fit(ids, labels, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                    verbose=0)
for epoch, loss in enumerate(history.history["loss"]):
    print(f"epoch {epoch}: loss {loss:.6f}")
