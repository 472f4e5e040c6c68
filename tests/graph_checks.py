"""What every graph test checks: ops' shapes against Keras's own shape
inference, topological order, and SOAP dims a strategy may split."""

import unittest

import keras

from flexflow_keras import capabilities
from flexflow_keras.graph import PARAMETER, SAMPLE, SOAP_KINDS, Op, OpGraph
from flexflow_keras.keras_graph import build_graph, fill_arguments

BATCH = 4


def keras_output_shapes(op: Op) -> list[tuple[int, ...]]:
    """Output shapes Keras infers for `op` fed full-batch input shapes."""
    from keras.src.backend import KerasTensor

    values = {
        name: KerasTensor(shape)
        for name, shape in zip(op.inputs, op.input_shapes)
    }
    args, kwargs = fill_arguments(op, values)
    spec = op.layer.compute_output_spec(*args, **kwargs)
    return [tuple(t.shape) for t in keras.tree.flatten(spec)]


def model_output_shapes(
    model: keras.Model, batch: int
) -> list[tuple[int, ...]]:
    return [
        tuple(batch if d is None else d for d in t.shape) for t in model.outputs
    ]


class GraphAssertions(unittest.TestCase):
    """Checks every test model must pass."""

    def assert_consistent(
        self, model: keras.Model, batch: int = BATCH
    ) -> OpGraph:
        graph = build_graph(model, batch)
        for op in graph:
            self.assertEqual(
                [tuple(s) for s in op.output_shapes],
                keras_output_shapes(op),
                msg=op.name,
            )
            for tensor in op.inputs:  # topological order
                producer = graph.producer(tensor)
                if producer is not None:
                    self.assertLess(
                        graph.ops.index(producer), graph.ops.index(op)
                    )
            self.assert_valid_partitioning(op, batch)
        self.assertEqual(
            [graph.tensors[t].shape for t in graph.outputs],
            model_output_shapes(model, batch),
        )
        return graph

    def assert_valid_partitioning(self, op: Op, batch: int) -> None:
        kinds = op.partitionable
        if capabilities.of_type(op.type).replicated_ops:
            self.assertEqual(kinds, {}, msg=op.name)  # runs replicated
        else:
            self.assertEqual(kinds.get(0), SAMPLE, msg=op.name)
        self.assertEqual(op.output_shape[0], batch, msg=op.name)
        self.assertTrue(set(kinds.values()) <= set(SOAP_KINDS))
        self.assertTrue(all(0 <= d < op.rank for d in kinds), msg=op.name)
        parameter_dims = [d for d, k in kinds.items() if k == PARAMETER]
        self.assertLessEqual(len(parameter_dims), 1, msg=op.name)
        for w in op.weights:
            if w.shard_axis is None:
                continue
            # A parameter split cuts the weight where it cuts the output.
            self.assertEqual(
                w.shape[w.shard_axis],
                op.output_shape[op.parameter_dim],
                msg=f"{op.name} {w.path}",
            )
