"""The TensorFlow side, one room per role (tests/unit/test_layout.py checks which room imports
which):

- `graph/`: what a traced step is made of (`ParallaxVariable`, `RemoteTable`'s ops, the step
  fusion, the analysis of how each variable is read); it imports no other room.
- `collectives/`: the workers' dense collectives, the `Workers` interface and its backends
  (`BACKENDS`: Horovod, TensorFlow's collective ops, a single worker).
- `state/`: the tables' state over time (exact resume, live resharding, the tuner).
- `keras_patches.py`: every change parallax makes to Keras, for the versions it names
  (`KERAS_VERSIONS`); `keras_support.py`: what it only reads of Keras.
- `strategy/`: `ParallaxStrategy` and what puts a plan into effect (binding, datasets), the
  only room that imports all the others.

The only package that imports TensorFlow, with the Keras layers and the benchmark's training
processes (tests/unit/test_layout.py checks it). The numpy side of the fused pull and push
ops, and of a variable on the servers, is `parallax.client.step` and
`parallax.client.table_rows`.
"""
