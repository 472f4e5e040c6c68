"""The runtime's functions run without Grappler's memory optimizer, and
only they do (`runtime/tracing.py`).

Why: its AddN scheduling put a TemporaryVariable, named by loop frame and
iteration, into the rolled LSTM's backward loop, and the second virtual
device's variable of that name failed keras.io's IMDB Bidirectional LSTM
at its first step (`tests/test_rolled_rnn.py`'s IMDB-size test, marked
slow, trains that model)."""

import unittest

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from flexflow_keras.runtime import tracing

NO_MEM_OPT = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT


def memory_optimization() -> int:
    """The memory optimizer's setting functions called now get."""
    config = config_pb2.ConfigProto()
    config.ParseFromString(
        context.context().function_call_options.config_proto_serialized)
    return config.graph_options.rewrite_options.memory_optimization


class TracingTest(unittest.TestCase):
    def test_step_functions_run_without_the_memory_optimizer(self):
        seen = []

        def add_one(x):
            seen.append(memory_optimization())
            return x + 1

        function = tracing.step_function(add_one)
        self.assertEqual(float(function(tf.constant(1.0))), 2.0)
        self.assertEqual(seen, [NO_MEM_OPT])  # traced within the call
        self.assertEqual(function.experimental_get_tracing_count(), 1)

    def test_other_functions_keep_tensorflows_default(self):
        before = memory_optimization()
        self.assertNotEqual(before, NO_MEM_OPT)
        with tracing.without_memory_rewrites():
            self.assertEqual(memory_optimization(), NO_MEM_OPT)
        self.assertEqual(memory_optimization(), before)
        tracing.step_function(lambda x: x * 2)(tf.constant(3.0))
        self.assertEqual(memory_optimization(), before)


if __name__ == "__main__":
    unittest.main()
