"""Package and wire-protocol versions (the protocol version is the proto package's `v1`)."""
__version__ = "0.1.0"
PROTOCOL_VERSION = 1
