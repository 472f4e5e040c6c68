"""StepVariables: writes in a traced step kept, emitted once at its end."""

import unittest

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras import devices
from flexflow_keras.runtime import deferred
from flexflow_keras.runtime.layouts import MeshCache, replicated
from flexflow_keras.runtime.variables import gather, to_layout


class DeferredTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.mesh = MeshCache(devices.device_names()).get((4,), (0, 1, 2, 3))

    def variable(self, value):
        value = np.asarray(value, np.float32)
        return deferred.StepVariable(
            to_layout(value, replicated(self.mesh, value.ndim))
        )

    def value(self, var):
        return gather(var.read_value()).numpy()

    def test_reads_after_writes_see_the_written_value(self):
        total, count = self.variable(0.0), self.variable(0.0)

        @tf.function(autograph=False)
        def step(x):
            with deferred.deferring([total, count]):
                total.assign_add(x)
                count.assign_add(tf.ones_like(x))
                total.assign_add(x)  # a second write sees the first
                mean = tf.convert_to_tensor(total) / count.read_value()
            return mean

        x = to_layout(np.float32(3.0), replicated(self.mesh, 0))
        self.assertEqual(float(gather(step(x))), 6.0)
        self.assertEqual(float(gather(step(x))), 6.0)  # 12 / 2
        self.assertEqual(self.value(total), 12.0)
        self.assertEqual(self.value(count), 2.0)

    def test_select_cond_keeps_the_taken_branch_writes(self):
        var = self.variable([1.0, 2.0])

        @tf.function(autograph=False)
        def step(pick):
            with deferred.deferring([var]):
                cond = deferred.select_cond([var])
                return cond(
                    pick > 0,
                    lambda: var.assign(var * 10.0),
                    lambda: var.assign_sub(tf.ones_like(var)),
                )

        one = to_layout(np.float32(1.0), replicated(self.mesh, 0))
        zero = to_layout(np.float32(0.0), replicated(self.mesh, 0))
        step(one)
        np.testing.assert_array_equal(self.value(var), [10.0, 20.0])
        step(zero)
        np.testing.assert_array_equal(self.value(var), [9.0, 19.0])

    def test_outside_a_trace_writes_are_immediate(self):
        var = self.variable([1.0, 2.0])
        var.assign(to_layout(np.float32([5.0, 6.0]), replicated(self.mesh, 1)))
        np.testing.assert_array_equal(self.value(var), [5.0, 6.0])


    def test_a_tape_after_a_write_differentiates_the_written_value(self):
        # A GAN's second discriminator update in one step: the tape opened
        # after the first update's write must watch the variable and get
        # the gradient at the written value (it got None).
        var = self.variable([1.0, 2.0])
        table = self.variable([[1.0], [2.0], [3.0]])

        @tf.function(autograph=False)
        def step():
            with deferred.deferring([var, table]):
                var.assign(var * 3.0)
                table.assign_add(tf.ones_like(table))
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(var * var) + tf.reduce_sum(
                        tf.gather(table, [2, 2])  # the sparse read path
                    )
                self.assertEqual(len(tape.watched_variables()), 2)
                grad_var, grad_table = tape.gradient(loss, [var, table])
                self.assertIsNotNone(grad_var)
                self.assertIsNotNone(grad_table)
                return grad_var, tf.convert_to_tensor(grad_table)

        grad_var, grad_table = step()
        np.testing.assert_allclose(gather(grad_var).numpy(), [6.0, 12.0])
        np.testing.assert_allclose(gather(grad_table).numpy(),
                                   [[0.0], [0.0], [2.0]])


if __name__ == "__main__":
    unittest.main()
