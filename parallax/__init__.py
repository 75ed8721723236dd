"""parallax: sparsity-aware data-parallel training for TensorFlow 2.

Importing `parallax` loads only the low layers (errors, specs, logging): the client, the
strategy (TensorFlow) and the partition search are loaded when first named, so the servers
and the launcher, which import parallax's protocol, never load the client or TensorFlow.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from parallax.errors import ConfigError, InternalError, ParallaxError, ServerError
from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Initializer, Lion, Nadam,
                                     RMSprop, TableSpec)
from parallax.runtime.logs import install as _install_logging
from parallax.version import __version__

if TYPE_CHECKING:
    from parallax.client import CacheStats, ClientOptions, PSClient, RowCache, ShardedTable
    from parallax.placement.tuning import PartitionSearch
    from parallax.tf.strategy.parallax_strategy import ParallaxStrategy

__all__ = ["Adagrad", "Adam", "Adamax", "CacheStats", "ClientOptions", "ConfigError", "Ftrl",
           "Initializer", "InternalError", "Lion", "Nadam", "PSClient", "ParallaxError",
           "ParallaxStrategy", "PartitionSearch", "RMSprop", "RowCache", "SGD", "ServerError",
           "ShardedTable", "TableSpec", "__version__"]

_install_logging()  # the "parallax" logger writes to stderr (parallax.runtime.logs)

_LAZY = {"ClientOptions": "parallax.client", "PSClient": "parallax.client",
         "RowCache": "parallax.client", "CacheStats": "parallax.client",
         "ShardedTable": "parallax.client", "PartitionSearch": "parallax.placement.tuning",
         # the last imports TensorFlow
         "ParallaxStrategy": "parallax.tf.strategy.parallax_strategy"}


def __getattr__(name: str):
    if name == "layers":  # parallax.layers.DynamicEmbedding (imports TensorFlow and Keras)
        return importlib.import_module("parallax.layers")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parallax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
