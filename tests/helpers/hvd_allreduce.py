"""Run under horovodrun: each rank all-reduces its rank number; prints the average."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd.init()
value = hvd.allreduce(tf.constant([float(hvd.rank()), 1.0]), op=hvd.Sum)
print(f"HVD rank={hvd.rank()} size={hvd.size()} sum={value.numpy().tolist()}", flush=True)
