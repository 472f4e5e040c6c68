"""Model shapes and layers under a searched strategy (issue 10, part).

Same check as `test_own_step.py` (2 epochs under `compile(search_budget=30)`
on 4 virtual devices against plain Keras from the same weights: more than
one device, no hand-over to plain Keras, losses and weights within 1e-5),
for subclassed models and for layers whose TensorFlow ops DTensor has no
rule for (run replicated or replaced: `runtime/op_rules.py`).
"""

import unittest

import keras
import numpy as np
import pytest

from runtime_support import assert_not_handed_over
from test_own_step import SAMPLES, train_both


def _images(seed=0, shape=(8, 8, 3)):
    rng = np.random.default_rng(seed)
    return rng.random((SAMPLES,) + shape, dtype=np.float32)


def _targets(width=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(SAMPLES, width)).astype("float32")


def _head(mod, h):
    return mod.layers.Dense(4)(mod.layers.Flatten()(h))


def image_layer(make):
    """A one-layer image model: `make(mod)` is the layer."""

    def build(mod):
        inputs = mod.Input((8, 8, 3))
        model = mod.Model(inputs, _head(mod, make(mod)(inputs)))
        model.compile(optimizer="adam", loss="mse")
        return model, (_images(), _targets())

    return build


def sequence_layer(make):
    def build(mod):
        inputs = mod.Input((6, 3))
        model = mod.Model(inputs, _head(mod, make(mod)(inputs)))
        model.compile(optimizer="adam", loss="mse")
        x = np.random.default_rng(0).random((SAMPLES, 6, 3), dtype=np.float32)
        return model, (x, _targets())

    return build


def build_shared_avgpool_tower(mod):
    tower = mod.Sequential([
        mod.Input((8, 8, 3)),
        mod.layers.Conv2D(4, 3, padding="same", activation="relu"),
        mod.layers.AveragePooling2D(2),
        mod.layers.Flatten(),
    ], name="tower")
    left, right = mod.Input((8, 8, 3)), mod.Input((8, 8, 3))
    merged = mod.layers.Concatenate()([tower(left), tower(right)])
    model = mod.Model([left, right], mod.layers.Dense(4)(merged))
    model.compile(optimizer="adam", loss="mse")
    return model, ([_images(0), _images(1)], _targets())


def build_subclassed_mlp(mod):
    class MLP(mod.Model):
        def __init__(self):
            super().__init__()
            self.hidden = mod.layers.Dense(16, activation="relu")
            self.out = mod.layers.Dense(4)

        def call(self, x):
            return self.out(self.hidden(x))

    model = MLP()
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(SAMPLES, 8)).astype("float32")
    return model, (x, _targets())


def build_subclassed_recommender(mod):
    class Recommender(mod.Model):
        """User and item embeddings, their product scored by a Dense."""

        def __init__(self):
            super().__init__()
            self.users = mod.layers.Embedding(20, 8)
            self.items = mod.layers.Embedding(30, 8)
            self.score = mod.layers.Dense(1)

        def call(self, inputs):
            user, item = inputs
            both = self.users(user) * self.items(item)
            return self.score(mod.ops.squeeze(both, axis=1))

    model = Recommender()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    users = rng.integers(0, 20, (SAMPLES, 1))
    items = rng.integers(0, 30, (SAMPLES, 1))
    return model, ((users, items), _targets(1))


class ConvOp(keras.layers.Conv2D):
    """A custom Conv2D overriding `convolution_op` (scaled inputs)."""

    def convolution_op(self, inputs, kernel):
        return keras.ops.conv(
            inputs * 0.5, kernel, strides=list(self.strides),
            padding=self.padding, dilation_rate=self.dilation_rate,
            data_format=self.data_format,
        )


def build_atrous_pyramid(mod):
    """DeepLabV3+'s pyramid in small (keras.io's `deeplabv3_plus`):
    dilated convolutions of several rates (3 does not divide the 8-pixel
    image: the phases pad it) side by side, joined, with batch
    normalization and Dropout after; Adam. No biases before the
    normalization: their gradient is rounding noise, which Adam scales
    up to its learning rate."""
    inputs = mod.Input((8, 8, 3))
    branches = [mod.layers.Conv2D(4, 1, use_bias=False)(inputs)] + [
        mod.layers.Conv2D(4, 3, dilation_rate=rate, padding="same",
                          use_bias=False)(inputs)
        for rate in (2, 3)
    ] + [mod.layers.SeparableConv2D(4, 3, dilation_rate=(2, 1),
                                    padding="same", use_bias=False)(inputs)]
    h = mod.layers.Concatenate()(branches)
    h = mod.layers.BatchNormalization()(h)
    h = mod.layers.Dropout(0.3)(mod.layers.Activation("relu")(h))
    model = mod.Model(inputs, _head(mod, h))
    model.compile(optimizer="adam", loss="mse")
    return model, (_images(), _targets())


class RelativePositionBias(keras.layers.Layer):
    """keras.io's Swin Transformer window attention in small: queries,
    keys and values cut from one Dense (the batch moved to dim 1 and
    back), and a bias looked up from a trainable table by an index kept
    in a non-trainable variable (`ops.take`), added to the scores. Four
    heads: with two, a 4-way batch split fails in DTensor ("dimension
    size=2 is not divisible by number of shards ... 4"): its layout
    propagation moves the batch's split onto the heads, with or without
    the lookup rule (a limit of DTensor's, noted in docs/RUNTIME.md)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = self.add_weight(shape=(9, 4),
                                     initializer="random_normal")
        self.index = keras.Variable(
            np.random.default_rng(0).integers(0, 9, (4, 4)), dtype="int",
            trainable=False)
        self.qkv = keras.layers.Dense(3 * 8)

    def call(self, x):
        ops = keras.ops
        qkv = ops.reshape(self.qkv(x), (-1, 4, 3, 4, 2))
        qkv = ops.transpose(qkv, (2, 0, 3, 1, 4))
        q, k, v = qkv[0] * 0.5, qkv[1], qkv[2]
        scores = q @ ops.transpose(k, (0, 1, 3, 2))
        bias = ops.take(self.table, ops.reshape(self.index, (-1,)), axis=0)
        bias = ops.transpose(ops.reshape(bias, (4, 4, -1)), (2, 0, 1))
        scores = ops.softmax(scores + ops.expand_dims(bias, 0), axis=-1)
        return ops.reshape(ops.transpose(scores @ v, (0, 2, 1, 3)),
                           (-1, 4, 8))


class ShiftedWindows(keras.layers.Layer):
    """keras.io's Swin Transformer shifted block in small: the image
    rolled by half a window along height and width (`ops.roll`, which
    DTensor has no rule for), cut into 2x2 windows beside the batch,
    attended within each window, put back and rolled back."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = RelativePositionBias()

    def call(self, x):
        ops = keras.ops
        x = ops.roll(x, shift=[-1, -1], axis=[1, 2])
        windows = ops.reshape(x, (-1, 4, 2, 4, 2, 4))
        windows = ops.reshape(ops.transpose(windows, (0, 1, 3, 2, 4, 5)),
                              (-1, 4, 4))
        out = ops.reshape(self.attention(windows), (-1, 4, 4, 2, 2, 8))
        out = ops.reshape(ops.transpose(out, (0, 1, 3, 2, 4, 5)),
                          (-1, 8, 8, 8))
        return ops.roll(out, shift=[1, 1], axis=[1, 2])


def build_shifted_windows(mod):
    inputs = mod.Input((8, 8, 3))
    h = ShiftedWindows()(mod.layers.Dense(4)(inputs))
    model = mod.Model(inputs, _head(mod, h))
    model.compile(optimizer="adam", loss="mse")
    return model, (_images(), _targets())


def build_relative_position_bias(mod):
    inputs = mod.Input((4, 3))
    h = RelativePositionBias()(mod.layers.Dense(4)(inputs))
    model = mod.Model(inputs, _head(mod, h))
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).random((SAMPLES, 4, 3), dtype=np.float32)
    return model, (x, _targets())


FEATURES = {
    "subclassed_mlp": build_subclassed_mlp,
    "subclassed_recommender": build_subclassed_recommender,
    # A one-layer Conv2D + AveragePooling2D model crashed DTensor; the
    # pooling now runs replicated on the mesh, the convolution split.
    "average_pooling": image_layer(
        lambda mod: mod.Sequential([
            mod.layers.Conv2D(8, 3, padding="same"),
            mod.layers.AveragePooling2D(2),
        ])
    ),
    "shared_tower_average_pooling": build_shared_avgpool_tower,
    "bidirectional_lstm": sequence_layer(
        lambda mod: mod.layers.Bidirectional(
            mod.layers.LSTM(4, return_sequences=True)
        )
    ),
    "gru_go_backwards": sequence_layer(
        lambda mod: mod.layers.GRU(4, go_backwards=True)
    ),
    "depthwise_conv": image_layer(
        lambda mod: mod.layers.DepthwiseConv2D(3, padding="same")
    ),
    "separable_conv": image_layer(
        lambda mod: mod.layers.SeparableConv2D(4, 3, padding="same")
    ),
    "dilated_conv": image_layer(
        lambda mod: mod.layers.Conv2D(4, 3, dilation_rate=2, padding="same")
    ),
    "dilated_separable_conv": image_layer(
        lambda mod: mod.layers.SeparableConv2D(4, 3, dilation_rate=2,
                                               padding="same")
    ),
    "conv_transpose": image_layer(
        lambda mod: mod.layers.Conv2DTranspose(4, 3, strides=2,
                                               padding="same")
    ),
    "custom_convolution_op": image_layer(
        lambda mod: ConvOp(4, 3, padding="same")
    ),
    # TensorFlow has no CPU kernel for their gradients (plain Keras
    # compiles them with XLA): depthwise with a multiplier, two groups
    # of 3 channels, dilated depthwise (ConvNeXt's, focal modulation's).
    "grouped_convs": image_layer(
        lambda mod: mod.Sequential([
            mod.layers.Conv2D(6, 3, groups=3, padding="same",
                              activation="gelu"),
            mod.layers.Conv2D(6, 3, groups=2, padding="same"),
            mod.layers.Conv2D(6, 3, groups=6, dilation_rate=2,
                              padding="same"),
        ])
    ),
    "grouped_conv1d": sequence_layer(
        lambda mod: mod.layers.Conv1D(6, 3, groups=3, padding="causal")
    ),
    "atrous_pyramid": build_atrous_pyramid,
    "relative_position_bias": build_relative_position_bias,
    "shifted_windows": build_shifted_windows,
}
FAST = (
    "subclassed_mlp", "average_pooling", "shared_tower_average_pooling",
    "bidirectional_lstm", "atrous_pyramid", "relative_position_bias",
    "shifted_windows", "grouped_convs",
)


class LayerSupportTest(unittest.TestCase):
    def test_features(self):
        for name in FAST:
            with self.subTest(feature=name):
                train_both(self, name, FEATURES[name])


@pytest.mark.slow
class LayerSupportMatrixTest(unittest.TestCase):
    def test_every_feature(self):
        for name, build in FEATURES.items():
            with self.subTest(feature=name):
                train_both(self, name, build)


def random_strategy_steps(test, names, count):
    """`count` random strategies from the searched space per model, one
    training step each: none may crash or hand over to plain Keras."""
    import random
    import warnings

    from flexflow_keras import runtime, search_space
    from flexflow_keras.keras_graph import build_graph

    import flexflow_keras as fk

    for name in names:
        keras.utils.set_random_seed(7)
        model, (x, y) = FEATURES[name](fk)
        take = lambda v: v[:16]  # noqa: E731
        x16 = keras.tree.map_structure(take, x)
        y16 = take(y)
        model.fit(x16, y16, batch_size=16, verbose=0)  # plans, traces
        graph = build_graph(model, 16)
        parts = None
        if runtime.own_step_reasons(model) or any(
            op.shares_weights_with for op in graph
        ):
            parts = search_space.one_mesh_devices(graph, 4)
        rng = random.Random(name)
        for index in range(count):
            strategy = search_space.random_strategy(graph, 4, rng, parts)
            with test.subTest(model=name, strategy=index), \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runtime.attach_strategy(model, graph, strategy)
                logs = model.train_on_batch(x16, y16, return_dict=True)
                test.assertTrue(np.isfinite(logs["loss"]), strategy)
                assert_not_handed_over(
                    test, [str(w.message) for w in caught], strategy)


class RandomStrategyTest(unittest.TestCase):
    def test_a_few_per_model(self):
        random_strategy_steps(
            self, ("subclassed_mlp", "shared_tower_average_pooling"), 3
        )


@pytest.mark.slow
class RandomStrategySweepTest(unittest.TestCase):
    def test_fifty_per_model(self):
        random_strategy_steps(self, tuple(FEATURES), 50)



def _failing_steps(fail_at, part):
    """`step.Executor._fn` whose `part` functions ("forward" or
    "backward") raise TensorFlow's error for a grouped convolution (as
    ConvNeXt's first step did on a CPU mesh before `op_rules.ungrouped`)
    at the first call of the `fail_at`-th training step, before any
    weight took it: "backward" after the loss function updated the
    metrics. Returns (the replacement, the training steps begun)."""
    import tensorflow as tf

    from flexflow_keras.runtime import step

    original_fn = step.Executor._fn
    original_train = step.Executor.train_batch
    steps, failed = [], []

    def train_batch(self, data):
        steps.append(1)
        return original_train(self, data)

    def fn(self, kind, *key):
        function = original_fn(self, kind, *key)
        if kind != part:
            return function

        def run(*args):
            if len(steps) == fail_at and not failed:
                failed.append(1)
                raise tf.errors.UnimplementedError(
                    None, None, "Fused conv implementation does not "
                    "support grouped convolutions for now.")
            return function(*args)

        return run

    return {"_fn": fn, "train_batch": train_batch}, steps


def _fit_failing_at(test, fail_at, part):
    """Plain Keras and ours over two meshes (`several_meshes`: the
    layer-by-layer executor) with a metric, batch statistics and
    Dropout (state a failed run must leave as it was), ours failing in its
    `fail_at`-th step's first `part` function (`_failing_steps`)."""
    from unittest import mock

    from flexflow_keras.runtime import step
    from runtime_support import fit_plain_and_ours, several_meshes

    def build(mod):
        inputs = mod.Input((8, 8, 3))
        h = mod.layers.Conv2D(4, 3, padding="same", activation="relu")(
            inputs)
        h = mod.layers.BatchNormalization()(h)
        return mod.Model(inputs, _head(mod, mod.layers.Dropout(0.3)(h)))

    replacements, steps = _failing_steps(fail_at, part)
    with mock.patch.multiple(step.Executor, **replacements):
        runs = fit_plain_and_ours(
            build, several_meshes, 16, 0,
            {"optimizer": "adam", "loss": "mse", "metrics": ["mae"]},
            x=_images(), y=_targets(), epochs=2, shuffle=False, verbose=0)
    return runs, steps


class FirstStepHandOverTest(unittest.TestCase):
    """TensorFlow failing to run a step under the strategy, layer by
    layer over several meshes. A first run that failed before any weight
    took the step changed nothing: the model trains as plain Keras from
    there, saying so, equal to plain Keras. ConvNeXt's grouped
    convolution, before `op_rules.ungrouped`, raised "Fused conv
    implementation does not support grouped convolutions" from this
    executor's first step instead, where the model's own step (one mesh)
    handed over. A later step's failure is not DTensor's to blame: it is
    raised, as before."""

    def test_a_first_step_that_fails_hands_over(self):
        from runtime_support import assert_same_fits

        for part in ("forward", "backward"):
            with self.subTest(failing=part):
                (histories, models, messages), steps = _fit_failing_at(
                    self, 1, part)
                self.assertEqual(len(steps), 1)  # Keras ran the rest
                self.assertIsNone(models["ours"].strategy_executor)
                handed = [m for m in messages if "plain Keras" in m]
                self.assertEqual(len(handed), 1, messages)
                self.assertIn("could not run its first train step",
                              handed[0])
                self.assertIn("grouped convolutions", handed[0])
                # The batch counted once in the first epoch's loss and
                # metric: the failed run's metric updates were undone.
                assert_same_fits(self, histories, models)

    def test_a_later_step_that_fails_raises(self):
        import tensorflow as tf

        with self.assertRaisesRegex(tf.errors.UnimplementedError,
                                    "grouped convolutions"):
            _fit_failing_at(self, 3, "forward")
