"""parallax: sparsity-aware data-parallel training for TensorFlow 2."""
from parallax.client import ClientOptions, PSClient, ShardedTable
from parallax.errors import ConfigError, ParallaxError, ServerError
from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Initializer, Lion, Nadam,
                                     RMSprop, TableSpec)
from parallax.runtime.logs import install as _install_logging
from parallax.version import __version__

__all__ = ["Adagrad", "Adam", "Adamax", "ClientOptions", "ConfigError", "Ftrl", "Initializer",
           "Lion", "Nadam", "PSClient", "ParallaxError", "ParallaxStrategy", "PartitionSearch",
           "RMSprop", "SGD", "ServerError", "ShardedTable", "TableSpec", "__version__"]

_install_logging()  # the "parallax" logger writes to stderr (parallax.runtime.logs)


def __getattr__(name: str):
    # The strategy imports TensorFlow; parameter servers import this package without it.
    if name == "ParallaxStrategy":
        from parallax.tf.strategy import ParallaxStrategy
        return ParallaxStrategy
    if name == "PartitionSearch":
        from parallax.placement.tuning import PartitionSearch
        return PartitionSearch
    raise AttributeError(f"module 'parallax' has no attribute {name!r}")
