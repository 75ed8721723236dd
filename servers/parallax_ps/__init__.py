"""parallax parameter server: hosts sparse-table shards over gRPC (`parallax server`)."""
