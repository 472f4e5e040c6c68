"""The layer calls that run on the host before each step.

A lookup layer (StringLookup, IntegerLookup, TextVectorization,
HashedCrossing) cannot run on DTensor at all (its hash table crashes
it), and scripts call it on a raw feature, first thing
(`keras_graph.hosted_nodes` says which calls qualify). Such a call runs
here instead, on the host, on each batch as it comes, with the layer's
own Keras call: exactly what it computes in plain Keras. Its results go
into the step beside the batch, and when the model's own step calls the
layer there, the call returns them (`model_step.call_op`), so the step
still runs the user's `train_step`, `call` and losses unchanged.

The operator graph (`keras_graph.build_graph`) holds these results as
inputs of the step (`TensorInfo.hosted_by`), so the search and the
simulator see the model as it runs on the devices.
"""

from typing import Any

import tensorflow as tf
from keras import tree
from keras.src.trainers.data_adapters.data_adapter_utils import (
    unpack_x_y_sample_weight,
)

from flexflow_keras.keras_graph import function_of, hosted_nodes


class HostPrefix:
    """The hosted calls of one model and a compiled function that runs
    them on a batch's inputs.

    Args:
        model: The Keras model (functional, Sequential, or traced).
    """

    def __init__(self, model: Any):
        import keras

        function = function_of(model)
        nodes = hosted_nodes(function)
        self.layers = tuple(node.operation for node in nodes)
        self._structures = [node.outputs for node in nodes]
        # A model over the same layer objects, from the model's inputs to
        # the hosted results: Keras maps a batch's inputs (a dict by
        # name, a list, one tensor) onto them as the model itself does.
        self._model = keras.Model(
            function._inputs_struct,
            [kt for node in nodes for kt in node.outputs],
            name=f"{model.name}_host_prefix",
        ) if nodes else None
        self._function = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def compute(self, data: Any) -> tuple:
        """The hosted results for one batch (`data` as the step gets it:
        `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`), in
        `self.layers`' order, computed on the host's CPU."""
        if self._function is None:
            self._function = tf.function(
                lambda x: self._model(x, training=False),
                autograph=False, reduce_retracing=True,
            )
        x, _, _ = unpack_x_y_sample_weight(data)
        with tf.device("/CPU:0"):
            flat = tree.flatten(self._function(x))
        return tuple(flat)

    def results_by_layer(self, flat: tuple) -> dict[int, Any]:
        """`compute`'s results (or their traced stand-ins inside the
        step) keyed by the id of the layer that made them, packed as
        its call returns them."""
        results, at = {}, 0
        for layer, outputs in zip(self.layers, self._structures):
            count = len(outputs)
            values = list(flat[at:at + count])
            at += count
            results[id(layer)] = values[0] if count == 1 else values
        return results
