"""The TensorFlow side: the `tf.distribute` strategy, graph analysis, the variables it
places on the servers, step fusion, the dense collectives, datasets and Keras support.

The only package that imports TensorFlow, with the benchmark's training processes
(tests/unit/test_layout.py checks it). The numpy side of the fused pull and push ops, and of a
variable on the servers, is `parallax.client.step` and `parallax.client.table_rows`.
"""
