"""A subclassed model whose `call` needs the batch size as a number, and
whose own step passes its compiled metrics one of the model's outputs
(keras.io's PatchConvNet, both at once):
- its attention pooling repeats a class token `ops.shape(x)[0]` times;
  on inputs of any batch size that leaves the concatenated tensor's
  shape unknown, so the trace failed and the script trained as plain
  Keras on one device. It is now traced on fit's batch size, as Keras
  builds such a model on the first batch, and again on each other batch
  size it is planned for (a later fit's), and its steps are traced with
  the batch size written in (`keras_graph.trace_call`);
- its `train_step` passes the compiled metrics the logits of its two
  outputs; built before the step on both outputs, the top-5 accuracy
  left the logs, and `evaluate`'s three results became two (the script
  unpacks three). Keras builds them on what the step passes, and so do
  we now (`ModelStepExecutor._build`).
Dropout in the attention and the MLP trains them together with a
random draw, compared with plain Keras from the same seed.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk

from runtime_support import (
    assert_own_step_under_strategy, assert_same_fits, assert_same_runs,
    train_plain_and_ours,
)

ROWS, BATCH, CLASSES = 72, 16, 5  # each epoch ends on a batch of 8


def build(mod):
    ops = mod.ops

    class AttentionPooling(mod.layers.Layer):
        def build(self, input_shape):
            dim = input_shape[-1]
            self.cls = self.add_weight(shape=(1, 1, dim), name="cls",
                                       initializer="zeros")
            self.norm = mod.layers.LayerNormalization()
            self.attention = mod.layers.MultiHeadAttention(
                num_heads=1, key_dim=dim, dropout=0.2)
            self.mlp = mod.Sequential([
                mod.layers.Dense(dim, activation="gelu"),
                mod.layers.Dropout(0.2),
            ])
            self.flatten = mod.layers.Flatten()
            self.dense = mod.layers.Dense(CLASSES)

        def call(self, x):
            class_token = ops.repeat(self.cls, repeats=ops.shape(x)[0],
                                     axis=0)
            x = self.norm(ops.concatenate([class_token, x], axis=1))
            x, scores = self.attention(query=x[:, 0:1], key=x, value=x,
                                       return_attention_scores=True)
            token = self.flatten(class_token + x)
            token = token + self.mlp(token)
            return self.dense(token), ops.squeeze(scores)[..., 1:]

    class PatchNet(mod.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.stem = mod.Sequential([
                mod.layers.Conv2D(8, 3, strides=2, padding="same",
                                  activation="gelu"),
                mod.layers.Reshape((-1, 8)),
            ], name="stem")
            self.pooling = AttentionPooling(name="pooling")

        def _loss(self, data, training):
            images, labels = data
            logits, _ = self.pooling(self.stem(images), training=training)
            return self.compiled_loss(labels, logits), logits, labels

        def train_step(self, data):
            with tf.GradientTape() as tape:
                loss, logits, labels = self._loss(data, True)
            variables = self.trainable_variables
            grads = tape.gradient(loss, variables)
            self.optimizer.apply_gradients(zip(grads, variables))
            self.compiled_metrics.update_state(labels, logits)
            return {m.name: m.result() for m in self.metrics}

        def test_step(self, data):
            _, logits, labels = self._loss(data, False)
            self.compiled_metrics.update_state(labels, logits)
            return {m.name: m.result() for m in self.metrics}

        def call(self, images):
            return self.pooling(self.stem(images))

    model = PatchNet()
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(
        # Not Adam: its update of the attention's query bias, whose
        # gradient is float noise (~1e-9), is noise scaled up by 1/eps.
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
            keras.metrics.SparseTopKCategoricalAccuracy(2, name="top-2"),
        ],
        **options,
    )
    return model


class BatchInCallTest(unittest.TestCase):
    def test_trains_under_its_strategy_equal_to_plain_keras(self):
        rng = np.random.default_rng(0)
        x = rng.random((ROWS, 8, 8, 3)).astype("float32")
        y = rng.integers(0, CLASSES, (ROWS, 1))

        def train(model):
            history = model.fit(x, y, batch_size=BATCH, epochs=2,
                                validation_data=(x[:32], y[:32]),
                                shuffle=False, verbose=0).history
            again = model.fit(x, y, batch_size=BATCH // 2, epochs=1,
                              shuffle=False, verbose=0).history
            history = {key: values + again.get(key, [])
                       for key, values in history.items()}
            return history, model.evaluate(x, y, batch_size=BATCH,
                                            verbose=0)

        runs = train_plain_and_ours(build, 3, train)
        assert_own_step_under_strategy(self, runs)
        ours, (history, evaluated), _ = runs["ours"]
        plain, (plain_history, plain_evaluated), _ = runs["plain"]
        self.assertGreater(ours.strategy_executor.mesh.size, 1)
        # Planned on both fits' batch sizes, each on its own trace.
        plans = ours._flexflow_state.plans
        self.assertEqual(sorted(plans), [BATCH // 2, BATCH])
        for batch, plan in plans.items():
            self.assertEqual(plan.graph.op("pooling").output_shapes[0],
                             (batch, CLASSES))
        self.assertEqual(sorted(history), sorted(plain_history))
        self.assertEqual(len(evaluated), 3)
        np.testing.assert_allclose(evaluated, plain_evaluated, rtol=1e-5,
                                   atol=1e-6)
        assert_same_fits(self, {"plain": plain_history, "ours": history},
                         {"plain": plain, "ours": ours})

    def test_batch_size_it_cannot_be_traced_on_trains_as_plain_keras(self):
        """A later batch size whose trace fails: that fit trains as
        plain Keras, saying why, from the weights the strategy left."""
        from unittest import mock

        from flexflow_keras import keras_graph

        rng = np.random.default_rng(1)
        x = rng.random((ROWS, 8, 8, 3)).astype("float32")
        y = rng.integers(0, CLASSES, (ROWS, 1))
        traced = keras_graph._traced

        def refusing_half_batches(model, inputs):
            if keras.tree.flatten(inputs)[0].shape[0] == BATCH // 2:
                raise ValueError("refused")
            return traced(model, inputs)

        def train(model):
            first = model.fit(x, y, batch_size=BATCH, epochs=1,
                              shuffle=False, verbose=0).history
            with mock.patch.object(keras_graph, "_traced",
                                   refusing_half_batches):
                second = model.fit(x, y, batch_size=BATCH // 2, epochs=1,
                                   shuffle=False, verbose=0).history
            return {key: first[key] + second[key] for key in first}

        runs = train_plain_and_ours(build, 3, train)
        messages = [m for m in runs["ours"][2] if "plain Keras" in m]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn(f"runs on batches of {BATCH} but could not be traced "
                      f"on batches of {BATCH // 2} (ValueError: refused)",
                      messages[0])
        assert_same_runs(self, runs)


if __name__ == "__main__":
    unittest.main()
