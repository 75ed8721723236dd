"""The tables' state over time: `resume.py` (exact resume through TensorFlow's and Keras'
checkpoints; `inline_tables.py` when the servers cannot write one), `resharding.py` (live
resharding, job-wide) and `tuner.py` (the partition search during training)."""
