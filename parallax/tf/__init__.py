"""The TensorFlow side: the `tf.distribute` strategy, graph analysis, the variables it
places on the servers, step fusion, the dense collectives, datasets and Keras support.

The only package that imports TensorFlow, with the benchmark's training processes
(tests/unit/test_layout.py checks it). `step_traffic` is its numpy side: what the fused pull and
push ops run.
"""
