"""Client side of the parameter servers."""
from parallax.client.connection import ClientOptions, ServerConnection
from parallax.client.ps_client import PSClient
from parallax.client.table import ShardedTable

__all__ = ["ClientOptions", "PSClient", "ServerConnection", "ShardedTable"]
