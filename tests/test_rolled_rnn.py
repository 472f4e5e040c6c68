"""Recurrent models train under DTensor with rolled loops, equal to
plain Keras.

The one-mesh runtime runs Keras's own recurrent cells as `rolled_rnn`'s
while loops (a backward loop of its own, no TensorLists) instead of
unrolled: keras.io's IMDB Bidirectional LSTM reached its first step in
about 4 s instead of minutes. Each case below failed before its fix:
- a Dense on one device after the RNN (the RNN's result wanted
  replicated): "operand #0 does not dominate this use", until the last
  output came out of the loop's carries rather than a slice of all
  steps;
- a batch of 16 labels: DTensor folded them as constants and expanded
  the step again at the next batch, which names its loop functions as
  the first expansion did ("a different function with the same name
  already exists"): small step inputs go in padded;
- a second step (the last partial batch, validation): DTensor may give
  its loops an earlier expansion's names; the first run is redone
  (`rolled_rnn.name_clash`).
Masks, dropout and recurrent dropout, a Bidirectional and a GRU, Adam,
validation and a partial last batch, together.
"""

import unittest
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import runtime_support as support
from flexflow_keras.runtime import model_step, rolled_rnn, step
from flexflow_keras.strategy import ParallelConfig, Strategy

ROWS, STEPS, BATCH = 72, 7, 16  # 4 batches of 16 and one of 8
WHOLE_BATCHES = 64  # rows for tests whose point is not the partial batch


def build(mod, masked=True, steps=STEPS):
    """`masked=False`: no mask, no dropout, as in keras.io's IMDB script
    (a mask makes the model run its own step, on one mesh)."""
    ids = mod.Input((steps,), dtype="int32", name="ids")
    h = mod.layers.Embedding(20, 8, mask_zero=masked, name="emb")(ids)
    dropout = dict(dropout=0.2, recurrent_dropout=0.1, seed=5)
    h = mod.layers.Bidirectional(mod.layers.LSTM(
        6, return_sequences=True, **(dropout if masked else {})),
        name="bi")(h)
    h = mod.layers.GRU(5, name="gru")(h)
    return mod.Model(ids, mod.layers.Dense(1, activation="sigmoid",
                                          name="out")(h))


def data(seed, steps=STEPS, rows=ROWS):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 20, (rows, steps)).astype("int32")
    lengths = rng.integers(2, steps + 1, rows)
    ids[np.arange(steps)[None, :] >= lengths[:, None]] = 0
    return ids, (ids[:, 0] > 10).astype("float32")


def dense_on_one_device(graph):
    """Data parallelism, but the last Dense whole on device 0."""
    configs = dict(Strategy.data_parallel(graph, 4))
    configs["out"] = ParallelConfig((1, 1), (0,))
    return Strategy(configs)


class RolledRNNTest(unittest.TestCase):
    def fit_both(self, make_strategy, clashes=0,
                 executor_type=model_step.ModelStepExecutor, masked=True,
                 steps=STEPS, validate=True, rows=ROWS):
        """`validate=False`: no validation data, half the steps to trace
        (the name-clash test traces all four); `rows=WHOLE_BATCHES`: no
        partial last batch, one train step to trace, not two."""
        (x, y), validation = data(0, steps, rows), data(1, steps)
        calls = mock.patch.object(rolled_rnn, "rolled_rnn",
                                  wraps=rolled_rnn.rolled_rnn)
        with calls as rolled:
            histories, models, messages = support.fit_plain_and_ours(
                lambda mod: build(mod, masked, steps), make_strategy,
                BATCH, 3,
                dict(optimizer="adam", loss="binary_crossentropy",
                     metrics=["accuracy"]),
                x=x, y=y, epochs=2, shuffle=False,
                validation_data=validation if validate else None,
                verbose=0)
        support.assert_not_handed_over(self, messages, messages)
        executor = models["ours"].strategy_executor
        self.assertIsInstance(executor, executor_type)
        self.assertTrue(executor.loops.rolled, "fell back to unrolled loops")
        self.assertGreater(rolled.call_count, 0)
        if clashes:
            redos = sum(f.redos for f in executor._functions.values())
            # DTensor may refuse a name by chance too: at least these.
            self.assertGreaterEqual(redos, clashes)
        support.assert_same_fits(self, histories, models)

    def test_data_parallel(self):
        self.fit_both(lambda graph: Strategy.data_parallel(graph, 4))

    def test_blocks_of_steps(self):
        """19 steps: loop iterations of 2 steps each and 1 step after
        the loop (`rolled_rnn._block_size`), forward and backward, with
        the mask, both dropouts, a Bidirectional and a GRU; and the
        weights' gradients from all steps at once after the backward
        loop (`weight_gradients`)."""
        self.assertEqual(rolled_rnn._block_size(19), 2)
        self.assertEqual(rolled_rnn._block_size(STEPS), 1)
        self.assertEqual(rolled_rnn._block_size(200), 8)
        self.fit_both(lambda graph: Strategy.data_parallel(graph, 4),
                      steps=19, validate=False, rows=WHOLE_BATCHES)

    def test_dense_on_one_device(self):
        self.fit_both(dense_on_one_device, validate=False,
                      rows=WHOLE_BATCHES)

    def test_several_meshes(self):
        """The layer-by-layer executor: each segment's backward function
        recomputes its forward, and the loop's weights reach it as loop
        inputs (read under its StatelessScope, gone when the gradient
        runs: reading them there trained the RNN's weights as zero,
        keras.io's IMDB script 0.805 accurate against 0.9765)."""
        self.fit_both(support.several_meshes, executor_type=step.Executor,
                      masked=False, validate=False, rows=WHOLE_BATCHES)

    # Slow: an injected refusal redone four times, ~58 s (test_data_parallel
    # trains the same model under the same strategy by default)
    @pytest.mark.slow
    def test_name_clash_redone(self):
        """A first run DTensor refuses for a loop function's name (it
        happens by chance: `rolled_rnn.name_clash`) is traced again and
        redone, once per refusal, and trains equal to plain Keras."""
        call = model_step._StepFunction.__call__
        refused = []

        def refusing(function, batch):
            if (function.kind, batch.batch) in refused:
                return call(function, batch)
            refused.append((function.kind, batch.batch))
            raise tf.errors.InvalidArgumentError(
                None, None, "Cannot add function 'rnn_loop_1_body' "
                "because a different function with the same name "
                "already exists.")

        with mock.patch.object(model_step._StepFunction, "__call__",
                               refusing):
            self.fit_both(lambda graph: Strategy.data_parallel(graph, 4),
                          clashes=4)
        # train at 16 and 8 rows, test at 16 and 8 rows
        self.assertEqual(len(refused), 4, refused)


def build_one_hot(mod):
    """Deep Learning with Python's "LSTM with one-hot" text model: token
    ids one-hot encoded by a layer without weights, so nothing upstream
    of the LSTM needs its inputs' gradient."""

    class OneHot(mod.layers.Layer):
        def call(self, inputs):
            return mod.ops.one_hot(mod.ops.cast(inputs, "int32"), 20)

    ids = mod.Input((STEPS,), dtype="int32", name="ids")
    h = OneHot(name="one_hot")(ids)
    h = mod.layers.Bidirectional(mod.layers.LSTM(6), name="bi")(h)
    h = mod.layers.Dropout(0.3, seed=2, name="drop")(h)
    return mod.Model(ids, mod.layers.Dense(1, activation="sigmoid",
                                          name="out")(h))


def build_projected(mod):
    """Float sequences through a Dense, then a GRU: the Dense's weights
    need the loop's input gradient."""
    seqs = mod.Input((STEPS, 3), name="seqs")
    h = mod.layers.Dense(4, activation="tanh", name="proj")(seqs)
    h = mod.layers.GRU(5, name="gru")(h)
    return mod.Model(seqs, mod.layers.Dense(1, name="out")(h))


class InputGradientTest(unittest.TestCase):
    """The backward loop computes the gradient of the loop's inputs only
    where a tape will use it (`record.should_record_backprop`). For the
    one-hot model that gradient was a (steps, batch, vocabulary) buffer
    written block by block and a matmul per step that nothing read: 844
    ms a step against plain Keras's 257 ms at the book's sizes (200
    steps, 2,000 tokens, 2 virtual CPUs), 399 ms without it."""

    def fit_both(self, build, x, y, make_strategy, executor_type, loss):
        asked = []
        ask = rolled_rnn.record.should_record_backprop

        def asking(tensors):
            asked.append(ask(tensors))
            return asked[-1]

        with mock.patch.object(rolled_rnn.record, "should_record_backprop",
                               asking):
            histories, models, messages = support.fit_plain_and_ours(
                build, make_strategy, BATCH, 3,
                dict(optimizer="adam", loss=loss), x=x, y=y, epochs=2,
                shuffle=False, verbose=0)
        support.assert_not_handed_over(self, messages, messages)
        executor = models["ours"].strategy_executor
        self.assertIsInstance(executor, executor_type)
        self.assertTrue(executor.loops.rolled, "fell back to unrolled loops")
        support.assert_same_fits(self, histories, models)
        return asked

    def test_input_nothing_needs_gets_no_gradient(self):
        ids, y = data(0, rows=WHOLE_BATCHES)
        asked = self.fit_both(build_one_hot, ids, y,
                              lambda g: Strategy.data_parallel(g, 4),
                              model_step.ModelStepExecutor,
                              "binary_crossentropy")
        self.assertIn(False, asked)  # no tape watches the one-hot rows
        self.assertNotIn(True, asked)

    def test_input_gradient_a_layer_needs(self):
        rng = np.random.default_rng(4)
        x = rng.normal(size=(WHOLE_BATCHES, STEPS, 3)).astype("float32")
        y = x[:, -2:, 0].mean(axis=1, keepdims=True)
        for name, make, executor in (
                ("one mesh", lambda g: Strategy.data_parallel(g, 4),
                 model_step.ModelStepExecutor),
                ("several meshes", support.several_meshes, step.Executor)):
            with self.subTest(strategy=name):
                asked = self.fit_both(build_projected, x, y, make, executor,
                                      "mse")
                self.assertIn(True, asked)


class LoopWidthTest(unittest.TestCase):
    def test_loops_do_not_widen_as_steps_are_built(self):
        """Every step function built varies the loops' spare carries
        (`rolled_rnn.vary`), so that its redos after name clashes each
        trace a loop of a size of its own; the width cycles rather than
        grows. A count that only grew reached 223 after three of the
        suite's files, and `tests/test_unroll.py`'s Bidirectional test
        took 38 s after them against 16 s alone."""
        saved = list(rolled_rnn._SPARE_CARRIES)
        self.addCleanup(rolled_rnn._SPARE_CARRIES.__setitem__, 0, saved[0])
        widths = []
        for _ in range(5 * rolled_rnn.MAX_NAME_CLASHES):
            rolled_rnn.RedoneOnNameClash(lambda: None)
            widths.append(len(rolled_rnn._spare_carries()))
        self.assertLess(max(widths), rolled_rnn.MAX_NAME_CLASHES)
        # One step's first trace and its redos: all of other widths.
        for start in range(len(widths) - rolled_rnn.MAX_NAME_CLASHES):
            run = widths[start:start + rolled_rnn.MAX_NAME_CLASHES]
            self.assertEqual(len(set(run)), len(run), widths)


class LaterNameClashTest(unittest.TestCase):
    def test_a_later_call_refused_for_a_name_is_made_again(self):
        """DTensor expands a function again when its cache misses it
        (keras.io's IMDB LSTM: the last partial batch's backward, in the
        second epoch), and that expansion can be refused for a loop
        function's name as a first one can. The function is made again
        and the call redone, as on a first call; before, the refusal
        reached the step, which unrolled every loop and traced every
        function again (7-24 s each there)."""
        saved = list(rolled_rnn._SPARE_CARRIES)
        self.addCleanup(rolled_rnn._SPARE_CARRIES.__setitem__, 0, saved[0])
        made, calls = [], []

        def make():
            made.append(len(made))
            version = made[-1]

            def function(x):
                calls.append((version, x))
                if version == 0 and len(calls) == 2:
                    raise tf.errors.InvalidArgumentError(
                        None, None, "Cannot add function "
                        "'rnn_loop_grad_9198_cond' because a different "
                        "function with the same name already exists. "
                        "[Op:__inference_backward_8193]")
                return x + version

            return function

        redone = rolled_rnn.RedoneOnNameClash(make)
        self.assertEqual(redone(1), 1)  # the first call runs
        self.assertEqual(redone(2), 3)  # refused, made again, redone
        self.assertEqual(redone(3), 4)  # the new function from then on
        self.assertEqual(redone.redos, 1)
        self.assertEqual(calls, [(0, 1), (0, 2), (1, 2), (1, 3)])

    def test_other_errors_of_a_later_call_are_raised(self):
        def make():
            def function(x):
                if x:
                    raise tf.errors.InvalidArgumentError(
                        None, None, "Incompatible shapes")
                return x
            return function

        redone = rolled_rnn.RedoneOnNameClash(make)
        redone(0)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "Incompatible shapes"):
            redone(1)
        self.assertEqual(redone.redos, 0)


@pytest.mark.slow  # `tests/test_tracing.py` checks the option, fast
class IMDBSizeTest(unittest.TestCase):
    def test_imdb_size_data_parallel_over_two(self):
        """keras.io's IMDB Bidirectional LSTM at its own sizes (20,000 x
        128 embedding, 200 steps, LSTM(64) twice, batch 32), data
        parallel over 2 devices, two steps: equal to plain Keras.

        Failed before `tracing.without_memory_rewrites` at its first
        step: Grappler's memory optimizer turned an AddN of the backward
        loop into a TemporaryVariable named by frame and iteration, and
        the second device's variable of that name already existed
        ("AlreadyExistsError: Resource __per_step_0/.../tmp_var/...").
        Smaller sizes stay under the optimizer's memory threshold."""
        def build_imdb(mod):
            ids = mod.Input((200,), dtype="int32")
            h = mod.layers.Embedding(20000, 128)(ids)
            h = mod.layers.Bidirectional(
                mod.layers.LSTM(64, return_sequences=True))(h)
            h = mod.layers.Bidirectional(mod.layers.LSTM(64))(h)
            return mod.Model(
                ids, mod.layers.Dense(1, activation="sigmoid")(h))

        rng = np.random.default_rng(0)
        x = rng.integers(0, 20000, (64, 200)).astype("int32")
        y = rng.integers(0, 2, (64,)).astype("float32")
        histories, models, messages = support.fit_plain_and_ours(
            build_imdb, lambda graph: Strategy.data_parallel(graph, 2), 32, 3,
            dict(optimizer="adam", loss="binary_crossentropy",
                 metrics=["accuracy"]),
            x=x, y=y, epochs=1, shuffle=False, verbose=0)
        support.assert_not_handed_over(self, messages, messages)
        executor = models["ours"].strategy_executor
        self.assertTrue(executor.loops.rolled, "fell back to unrolled loops")
        support.assert_same_fits(self, histories, models)


if __name__ == "__main__":
    unittest.main()
