"""The contract the workers and the parameter servers share, and nothing else: table specs,
id routing, the wire formats (protobuf tensors, the bulk and packed codecs, data-plane
framing), initial values and job security.

No TensorFlow and no client here: the server (`servers/parallax_ps`) imports this package,
`parallax.runtime`, `parallax.env` and `parallax.errors`, and nothing else of parallax.
"""
