"""Client side of the parameter servers."""
from parallax.client.connection import ClientOptions, ServerConnection
from parallax.client.ps_client import PSClient
from parallax.client.row_cache import CacheStats, RowCache
from parallax.client.table import ShardedTable

__all__ = ["CacheStats", "ClientOptions", "PSClient", "RowCache", "ServerConnection",
           "ShardedTable"]
