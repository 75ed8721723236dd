"""The contract the workers and the parameter servers share, and nothing else: table specs,
id routing, the wire formats (protobuf tensors, the bulk and packed codecs, data-plane
framing), initial values, job security and the process tuning both sides apply.

No TensorFlow here: the server (`servers/parallax_ps`) imports this package and
`parallax.errors` only.
"""
