"""Keras layers of parallax: `DynamicEmbedding` (keys of any value, rows admitted and evicted
on the parameter servers) and `ServingEmbedding` (its exported rows, served without
parallax); `serving_model` swaps the one for the other in a whole model."""
from __future__ import annotations

from parallax.layers.dynamic_embedding import DynamicEmbedding, ServingEmbedding, hash_keys
from parallax.layers.serving import serving_model

__all__ = ["DynamicEmbedding", "ServingEmbedding", "hash_keys", "serving_model"]
