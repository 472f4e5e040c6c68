"""Cost model: roofline figures by hand; measured costs cached on disk."""

import os
import tempfile
import unittest
from unittest import mock

import model_zoo

from flexflow_keras import cost as cost_module
from flexflow_keras.cost import (
    CostModel, analytic_cost_model, analytic_op_ms, cache_key,
    measured_cost_model, shard_shapes,
)
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import DeviceSpec, load_machine
from flexflow_keras.strategy import ParallelConfig

# 1 TFLOP/s = 1e9 FLOP per ms; 1 GB/s = 1e6 bytes per ms.
SPEC = DeviceSpec("T", 0, 1e12, 2**30, 1.0, launch_overhead_ms=0.01)


def dense_op(batch=64, features=256, units=512):
    """A Dense whose input's gradient the step computes (a Dense before
    it), so its backward is both kernels."""
    import keras

    x = keras.Input((features,), name="x")
    h = keras.layers.Dense(features, name="before")(x)
    y = keras.layers.Dense(units, name="d")(h)
    return build_graph(keras.Model(x, y), batch).op("d")


class AnalyticTest(unittest.TestCase):
    def test_compute_bound_dense(self):
        op = dense_op(batch=64, features=256, units=512)
        cost = CostModel(load_machine("v100x4"), mode="analytic")
        spec = DeviceSpec("T", 0, 1e12, 2**30, 1e6, 0.01)  # huge bandwidth
        forward, backward = cost.op_cost(op, ParallelConfig((1, 1), (0,)),
                                         spec)
        self.assertAlmostEqual(forward, op.forward_flops / 1e9 + 0.01)
        self.assertAlmostEqual(backward, op.backward_flops / 1e9 + 0.02)

    def test_memory_bound_dense_counts_shard_bytes(self):
        op = dense_op(batch=64, features=256, units=512)
        cost = CostModel(load_machine("v100x4"), mode="analytic")
        config = ParallelConfig((2, 2), (0, 1, 2, 3))
        ins, out = shard_shapes(op, config)
        self.assertEqual(ins, ((32, 256),))  # all features, half the batch
        self.assertEqual(out, (32, 256))
        moved = 4 * (32 * 256 + 32 * 256 + (256 * 512 + 512) / 2)
        forward, backward = cost.op_cost(op, config, SPEC)
        self.assertAlmostEqual(forward, moved / 1e6 + 0.01)
        self.assertAlmostEqual(backward, 2 * moved / 1e6 + 0.02)

    def test_more_parts_cost_less_each(self):
        op = dense_op()
        cost = analytic_cost_model(load_machine("p100x16"))
        one = cost.op_cost(op, ParallelConfig((1, 1), (0,)), 0)
        four = cost.op_cost(op, ParallelConfig((4, 1), (0, 1, 2, 3)), 0)
        self.assertLess(four[0], one[0])

    def test_update_reads_and_writes_slots(self):
        cost = analytic_cost_model(load_machine("v100x4"))
        self.assertAlmostEqual(cost.update_ms(1e6, 2, SPEC),
                               0.01 + 7e6 / 1e6)

    def test_unknown_mode(self):
        with self.assertRaisesRegex(ValueError, "Received: mode='exact'"):
            CostModel(load_machine("v100x4"), mode="exact")


class MeasuredTest(unittest.TestCase):
    def test_second_compile_measures_nothing(self):
        graph = build_graph(model_zoo.mlp(), 16)
        config = ParallelConfig((1, 2), (0, 1))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "costs.json")
            first = measured_cost_model(path, load_machine(None))
            first.warmup, first.repeats = 1, 3
            costs = [first.op_cost(op, config, 0) for op in graph]
            self.assertEqual(first.num_measured, len(graph))
            self.assertTrue(all(f > 0 and b >= 0 for f, b in costs))
            again = measured_cost_model(path, load_machine(None))
            self.assertEqual([again.op_cost(op, config, 0) for op in graph],
                             costs)
            self.assertEqual(again.num_measured, 0)

    def test_key_names_shard_shape_dtype_and_device_kind(self):
        op = dense_op(batch=64, features=256, units=512)
        key = cache_key(op, ParallelConfig((1, 2), (0, 1)), "V100")
        self.assertIn("[[64, 256]], [64, 256], \"float32\", \"V100\"", key)
        self.assertIn('"units": 256', key)  # the shard's clone

    def test_key_of_a_users_layer_names_its_code(self):
        """Two scripts' layers of one class name and config, or one
        layer edited, run other code: their costs are kept apart. A
        Keras layer's key has no code digest (keys made before stay)."""
        import keras

        from test_code_digest import LAYER, defined_in_a_script

        def key_of(source):
            x = keras.Input((8,))
            graph = build_graph(keras.Model(
                x, defined_in_a_script(source)(name="e")(x)), 16)
            return cache_key(graph.op("e"), ParallelConfig((1, 1), (0,)),
                             "CPU")

        self.assertEqual(key_of(LAYER), key_of(LAYER))
        self.assertNotEqual(
            key_of(LAYER.replace("return x * 2.0", "return x * 4.0")),
            key_of(LAYER))
        self.assertNotIn("code digest", cache_key(
            dense_op(), ParallelConfig((1, 1), (0,)), "CPU"))

    def test_unmeasurable_op_falls_back_to_roofline(self):
        import dataclasses

        op = dataclasses.replace(dense_op(), layer=None)
        with tempfile.TemporaryDirectory() as folder:
            cost = measured_cost_model(os.path.join(folder, "c.json"),
                                       load_machine(None))
            got = cost.op_cost(op, ParallelConfig((1, 1), (0,)), 0)
        self.assertEqual(cost.num_measured, 0)
        self.assertEqual(len(cost.fallbacks), 1)
        self.assertTrue(got[0] > 0)

    def test_shard_is_timed_net_of_the_call(self):
        # Medians, in the order taken: forward, forward+backward, and an
        # empty function of the same inputs.
        op = dense_op(batch=8, features=4, units=4)
        with mock.patch.object(cost_module, "_median_ms",
                               side_effect=[1.5, 2.5, 0.4]):
            forward, backward = cost_module.measure_op_ms(
                op, ParallelConfig((1, 1), (0,)), 1, 3)
        self.assertAlmostEqual(forward, 1.1)
        self.assertAlmostEqual(backward, 1.0)
        # A call dearer than the op (noise) leaves 0, not below.
        with mock.patch.object(cost_module, "_median_ms",
                               side_effect=[0.3, 0.5, 0.4]):
            forward, _ = cost_module.measure_op_ms(
                op, ParallelConfig((1, 1), (0,)), 1, 3)
        self.assertEqual(forward, 0.0)

    def test_empty_call_is_timed_on_the_ops_inputs(self):
        import tensorflow as tf

        values = [tf.zeros((4, 3)), tf.zeros((2,), tf.int32)]
        call_ms = cost_module._call_ms(tf, values, 1, 3)
        self.assertGreater(call_ms, 0.0)
        self.assertLess(call_ms, 1000.0)
        # Traced once per ranks and dtypes, whatever the shapes.
        before = len(cost_module._EMPTY_STEPS)
        cost_module._call_ms(tf, [tf.zeros((7, 5)), tf.zeros((9,), tf.int32)],
                             1, 3)
        self.assertEqual(len(cost_module._EMPTY_STEPS), before)

    def test_shards_alike_but_for_the_batch_share_one_trace(self):
        """Each batch degree of a layer, and a layer of the same config
        and shard shapes, is timed on its own shapes by one trace; a
        layer whose call needs its batch as a number is traced on it."""
        import keras
        import tensorflow as tf

        def counted(name, batch, layer=None):
            x = keras.Input((6,), name="x")
            y = (layer or keras.layers.Dense(5, name=name))(x)
            return build_graph(keras.Model(x, y), batch).op(name)

        traces = []
        real = cost_module._step_functions

        def spy(*args, **kwargs):
            traces.append(kwargs.get("batched"))
            return real(*args, **kwargs)

        # Traces kept by earlier tests would answer before a trace here.
        with mock.patch.object(cost_module, "_step_functions", spy), \
                mock.patch.dict(cost_module._SHARD_STEPS, clear=True):
            for batch in (8, 16):
                op = counted("shared_trace_a", batch)
                for degree in (1, 2):
                    forward, backward = cost_module.measure_op_ms(
                        op, ParallelConfig((degree, 1), tuple(
                            range(degree))), 1, 2)
                    self.assertGreaterEqual(forward, 0.0)
            alike = counted("shared_trace_b", 8)
            cost_module.measure_op_ms(alike, ParallelConfig((1, 1), (0,)),
                                      1, 2)
        self.assertEqual(traces, [True])

        class FixedBatch(keras.layers.Layer):
            def call(self, x):  # the batch as a number: no unknown one
                return tf.reshape(x, (int(x.shape[0]), 6)) * 2.0

            def compute_output_shape(self, shape):
                return shape

        traces.clear()
        with mock.patch.object(cost_module, "_step_functions", spy), \
                mock.patch.dict(cost_module._SHARD_STEPS, clear=True):
            op = counted("fixed_batch", 8, FixedBatch(name="fixed_batch"))
            forward, _ = cost_module.measure_op_ms(
                op, ParallelConfig((1, 1), (0,)), 1, 2)
        self.assertEqual(traces, [True, False])
        self.assertGreaterEqual(forward, 0.0)

    def test_measured_shard_is_floored_at_the_roofline(self):
        op = dense_op(batch=8, features=4, units=4)
        config = ParallelConfig((2, 1), (0, 1))
        machine = load_machine(None)
        with tempfile.TemporaryDirectory() as folder:
            cost = measured_cost_model(os.path.join(folder, "c.json"),
                                       machine)
            with mock.patch.object(cost_module, "measure_op_ms",
                                   return_value=(0.0, 0.0)):
                got = cost.op_cost(op, config, 0)
        self.assertEqual(cost.num_measured, 1)
        self.assertEqual(
            got, analytic_op_ms(op, config, machine.devices[0]))

    def test_live_machine_defaults_to_measured(self):
        self.assertEqual(CostModel(load_machine(None)).mode, "measured")
        self.assertEqual(CostModel(load_machine("v100x4")).mode, "analytic")


if __name__ == "__main__":
    unittest.main()
