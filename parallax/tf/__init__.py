"""The TensorFlow side: the `tf.distribute` strategy, graph analysis, the variables it
places on the servers, step fusion, the dense collectives, datasets and Keras support.

The only package that imports TensorFlow (tests/unit/test_layout.py checks it).
"""
