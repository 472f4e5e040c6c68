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

Which result a call inside the step gets is decided by what it is
called on, traced back to the step's arguments: the batch's input it
reads (through the reshapes and casts Keras adds), or another hosted
result. A call on anything else (a user's step calling the model on
data of its own making) has no hosted result: `CalledElsewhere`, and the
model trains as plain Keras rather than take a wrong one.

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

# TensorFlow ops between a step's argument and a layer's input that
# keep its values (Keras's input conversion and rank adjustment).
_PASS_THROUGH = frozenset({
    "ExpandDims", "Squeeze", "Reshape", "Identity", "Cast", "StopGradient",
})


class CalledElsewhere(Exception):
    """A hosted layer called, inside the step, on something that is not
    the batch's input it was run on before the step."""


class HostPrefix:
    """The hosted calls of one model and a compiled function that runs
    them on a batch's inputs.

    Args:
        model: The Keras model (functional, Sequential, or traced).
    """

    def __init__(self, model: Any):
        import keras

        self._function = function_of(model)
        nodes = hosted_nodes(self._function)
        self.layers = frozenset(id(node.operation) for node in nodes)
        # What each call reads: ("input", i) for the model's input i,
        # ("hosted", j) for the j-th hosted result; and its results.
        source = {id(kt): ("input", i)
                  for i, kt in enumerate(self._function.inputs)}
        self._calls = []
        for node in nodes:
            reads = tuple(source[id(kt)]
                          for kt in node.arguments.keras_tensors)
            first = sum(len(n.outputs) for n, _, _ in self._calls)
            for k, kt in enumerate(node.outputs):
                source[id(kt)] = ("hosted", first + k)
            self._calls.append((node, reads, first))
        # A model over the same layer objects, from the model's inputs to
        # the hosted results: Keras maps a batch's inputs (a dict by
        # name, a list, one tensor) onto them as the model itself does.
        self._model = keras.Model(
            self._function._inputs_struct,
            [kt for node in nodes for kt in node.outputs],
            name=f"{model.name}_host_prefix",
        )
        self._compiled = None
        self._training = False  # while a step is traced
        self._origins: dict[str, tuple] = {}  # while a step is traced
        self._results: tuple = ()

    @property
    def variables(self) -> list:
        """The hosted calls' variables (an augmentation's seed state)."""
        return list(self._model.variables)

    def compute(self, data: Any, training: bool) -> tuple:
        """The hosted results for one batch (`data` as the step gets it:
        `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`), flat, in call
        order, computed on the host's CPU; `training` as the step's
        (an augmentation acts in train steps only)."""
        if self._compiled is None:
            self._compiled = {
                flag: tf.function(
                    lambda x, flag=flag: self._model(x, training=flag),
                    autograph=False, reduce_retracing=True)
                for flag in (False, True)
            }
        x, _, _ = unpack_x_y_sample_weight(data)
        with tf.device("/CPU:0"):
            return tuple(tree.flatten(self._compiled[training](x)))

    def begin(self, data: Any, results: tuple, training: bool) -> None:
        """While a step is traced: the traced batch and the traced
        hosted results (the step's arguments) that calls resolve to,
        computed with `training` (`compute`)."""
        self._training = training
        x, _, _ = unpack_x_y_sample_weight(data)
        flat = self._function._standardize_inputs(x)
        self._origins = {
            _key(_origin(value)): ("input", i)
            for i, value in enumerate(flat) if tf.is_tensor(value)
        }
        # By origin too: a small result went in padded (`variables.
        # padded`), and a hosted call reading it (a lookup of a hosted
        # `expand_dims`) gets it through the unpadding's reshape.
        self._origins.update({
            _key(_origin(value)): ("hosted", j)
            for j, value in enumerate(results)
        })
        self._results = results

    def end(self) -> None:
        self._origins, self._results = {}, ()

    def result(self, operation: Any, args: tuple, kwargs: dict) -> Any:
        """What the traced step's call `operation(*args, **kwargs)` of a
        hosted layer returns: the hosted result of the call that read
        the same inputs, packed as the layer returns it.

        Raises:
            CalledElsewhere: no hosted call of this layer read them, or
                the step calls it with another `training` than the host
                computed it with (an augmentation called with
                `training=False` in a train step would get augmented
                images).
        """
        training = kwargs.get("training")
        if isinstance(training, bool) and training != self._training:
            raise CalledElsewhere(
                f"Layer '{operation.name}' ({type(operation).__name__}) "
                "runs on the host before each step (TensorFlow's DTensor "
                f"cannot run it), with training={self._training} in this "
                f"kind of step, but the model's step calls it with "
                f"training={training}. Call the model with the default "
                "`training` of the step, or apply this layer in the "
                "tf.data pipeline."
            )
        reads = tuple(
            self._origins.get(_key(_origin(value)))
            for value in tree.flatten((args, kwargs)) if tf.is_tensor(value)
        )
        for node, node_reads, first in self._calls:
            if node.operation is operation and node_reads == reads:
                values = list(self._results[first:first + len(node.outputs)])
                return values[0] if len(values) == 1 else values
        raise CalledElsewhere(
            f"Layer '{operation.name}' ({type(operation).__name__}) runs "
            "on the host before each step, on the batch's inputs "
            "(TensorFlow's DTensor cannot run it), but the model's step "
            "calls it on other tensors, for which no result was computed "
            "there. Do this lookup in the tf.data pipeline, or call the "
            "model only on the batch in `train_step`."
        )


def _origin(value: Any) -> Any:
    """The tensor `value` was made from by ops that keep its values
    (`_PASS_THROUGH`): a step's argument, for what Keras hands a layer."""
    for _ in range(16):
        op = getattr(value, "op", None)
        if op is None or op.type not in _PASS_THROUGH or not op.inputs:
            break
        value = op.inputs[0]
    return value


def _key(value: Any) -> str:
    """A traced tensor's name, as a key (graph tensors are not
    hashable by value)."""
    return getattr(value, "name", None) or str(id(value))
