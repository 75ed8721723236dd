"""`serving_model`: a copy of a trained Keras model whose `DynamicEmbedding` layers are
replaced by `ServingEmbedding`s holding their exported rows (named keys, or the top-N most
used), and whose other weights are the model's, so it exports as a SavedModel that serves
without parallax or its servers."""
from __future__ import annotations

import keras

from parallax.errors import ConfigError
from parallax.layers.dynamic_embedding import DynamicEmbedding


def serving_model(model: keras.Model, keys=None, top_n: int | None = None) -> keras.Model:
    """The serving copy of `model` (functional or Sequential; build it outside any
    `strategy.scope()`). `keys`: a list of keys for every DynamicEmbedding, or a dict
    {layer name: keys}; `top_n` likewise an int or a dict. Neither: every row held."""
    dynamic = [layer for layer in _leaves(model) if isinstance(layer, DynamicEmbedding)]
    if not dynamic:
        raise ConfigError(f"model {model.name!r} has no DynamicEmbedding layer; export it as "
                          f"it is (model.export / tf.saved_model.save)")
    names = {layer.name for layer in dynamic}
    for option, given in (("keys", keys), ("top_n", top_n)):
        unknown = set(given) - names if isinstance(given, dict) else set()
        if unknown:
            raise ConfigError(f"serving_model {option} names {sorted(unknown)}, which are not "
                              f"DynamicEmbedding layers of {model.name!r}; known: "
                              f"{sorted(names)}")
    pick = lambda given, layer: given.get(layer.name) if isinstance(given, dict) \
        else given  # noqa: E731

    def clone(layer):
        if isinstance(layer, DynamicEmbedding):
            return layer.serving_layer(pick(keys, layer), pick(top_n, layer))
        return layer.__class__.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as err:
        raise ConfigError(f"serving_model copies functional and Sequential models; "
                          f"{model.name!r} could not be cloned ({err}): build the serving "
                          f"model yourself from layer.serving_layer() of each "
                          f"DynamicEmbedding") from err
    left = [layer.name for layer in _leaves(copy) if isinstance(layer, DynamicEmbedding)]
    if left:
        raise ConfigError(f"serving_model could not replace DynamicEmbedding layers {left} "
                          f"of {model.name!r} (inside a subclassed model?); build the serving "
                          f"model yourself from layer.serving_layer() of each")
    for source, target in zip(_leaves(model), _leaves(copy)):
        if not isinstance(source, DynamicEmbedding) and source.weights:
            target.set_weights(source.get_weights())
    return copy


def _leaves(model: keras.Model) -> list:
    """The layers of `model` (nested models' included) that hold their own weights."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if not list(layer._flatten_layers(include_self=False))]
