"""Proof that the plan is what runs: each op's layouts inside the step.

Equivalence tests (losses equal plain Keras) cannot see layouts: DTensor
computes the same values for any layout, so a model whose layer hook
stopped firing would pass them while training replicated. Here each
model runs one train step under random strategies drawn from the
one-mesh space (`search_space.random_strategy(..., one_mesh_parts=)`,
what models that run their own step are searched over), then
`runtime.realized.record` reads from DTensor the layout of every op's
inputs, outputs and weights inside the step, and every one must equal
its `OpPlan`'s. Some draws are made on a 2 x 2 mesh (`mesh_space`,
also searched for such models). The check is shown to fail with the
hook off.

Unmarked: 2 one-mesh strategies per model, one 2 x 2 strategy for 2
models; `-m slow`: 8 one-mesh and 4 2 x 2 strategies per model.
"""

import contextlib
import io
import os
import random
import unittest
from unittest import mock

import keras
import numpy as np
import pytest
from keras.src.ops.operation import Operation

import model_zoo
from flexflow_keras import mesh_space, runtime, search_space, settings
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.runtime import model_step, realized
from flexflow_keras.strategy import Strategy
from runtime_support import StrategyModel

BATCH, DEVICES = 16, 4


def _functional(base, cls=StrategyModel):
    """`base`'s layers in a model the runtime can run."""
    return cls(base._inputs_struct, base._outputs_struct, name=base.name)


def _rng(seed=0):
    return np.random.default_rng(seed)


def build_mlp():
    model = _functional(model_zoo.mlp(input_dim=8, hidden=(16, 16),
                                      classes=4))
    model.compile(optimizer="adam", loss="mse")
    x = _rng().random((BATCH, 8), dtype=np.float32)
    return model, (x, _rng(1).random((BATCH, 4), dtype=np.float32))


def build_cnn():
    inputs = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu",
                            name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Conv2D(8, 3, name="conv_2")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    outputs = keras.layers.Dense(4, name="logits")(h)
    model = StrategyModel(inputs, outputs)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x = _rng().random((BATCH, 8, 8, 3), dtype=np.float32)
    return model, (x, _rng(1).integers(0, 4, (BATCH,)))


def build_lstm():
    model = _functional(model_zoo.lstm_model(seq=4, features=4, units=8,
                                             classes=4))
    model.compile(optimizer="adam", loss="mse")
    x = _rng().random((BATCH, 4, 4), dtype=np.float32)
    return model, (x, _rng(1).random((BATCH, 4), dtype=np.float32))


def build_attention():
    model = _functional(model_zoo.transformer_block(seq=8, dim=16, heads=2))
    model.compile(optimizer="adam", loss="mse")
    x = _rng().random((BATCH, 8, 16), dtype=np.float32)
    return model, (x, _rng(1).random((BATCH, 8, 16), dtype=np.float32))


def build_keyword_attention():
    # Called by keyword, Keras lists the key first (sorted names):
    # inputs are (key, query, value), the query input 1.
    memory = keras.Input((8, 16), name="memory")
    target = keras.Input((8, 16), name="target")
    attended = keras.layers.MultiHeadAttention(
        2, 8, name="attention")(query=target, value=memory, key=memory)
    out = keras.layers.Dense(16, name="out")(attended)
    model = StrategyModel([memory, target], out)
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    x = [rng.random((BATCH, 8, 16), dtype=np.float32) for _ in range(2)]
    return model, (x, _rng(1).random((BATCH, 8, 16), dtype=np.float32))


def build_embedding():
    inputs = keras.Input((6,), dtype="int32", name="ids")
    h = keras.layers.Embedding(20, 8, name="embedding")(inputs)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    outputs = keras.layers.Dense(4, name="logits")(h)
    model = StrategyModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    ids = _rng().integers(0, 20, (BATCH, 6)).astype("int32")
    return model, (ids, _rng(1).random((BATCH, 4), dtype=np.float32))


def build_shared():
    model = _functional(model_zoo.shared_layer(input_dim=8, units=16))
    model.compile(optimizer="sgd", loss="mse")
    x = [_rng().random((BATCH, 8), dtype=np.float32),
         _rng(2).random((BATCH, 8), dtype=np.float32)]
    return model, (x, _rng(1).random((BATCH, 1), dtype=np.float32))


class PenaltyStepModel(StrategyModel):
    """A model running its own step: a `train_step` override adding a
    weight penalty to the compiled loss (with its layers' regularizers)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            total = loss + 0.01 * tf.add_n(
                [tf.reduce_sum(tf.square(w)) for w in self.trainable_weights]
            )
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(total)
        return {"loss": total}


def build_own_step():
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(
        16, activation="relu", kernel_regularizer="l2",
        activity_regularizer=keras.regularizers.L2(0.001), name="hidden",
    )(inputs)
    outputs = keras.layers.Dense(4, name="out")(h)
    model = PenaltyStepModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    x = _rng().random((BATCH, 8), dtype=np.float32)
    return model, (x, _rng(1).random((BATCH, 4), dtype=np.float32))


MODELS = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "lstm": build_lstm,
    "self_attention": build_attention,
    "embedding": build_embedding,
    "shared_layer": build_shared,
    "own_step_regularizers": build_own_step,
}


def random_one_mesh(seed):
    """A strategy drawn as for a model that runs its own step."""

    def make(graph):
        parts = search_space.one_mesh_devices(graph, DEVICES)
        return search_space.random_strategy(
            graph, DEVICES, random.Random(seed), one_mesh_parts=parts
        )

    return make


def one_step(build, make_strategy):
    """`build`'s model after one train step under `make_strategy(graph)`;
    (model, batch, strategy)."""
    keras.utils.set_random_seed(0)
    model, (x, y) = build()
    graph = build_graph(model, BATCH)
    strategy = make_strategy(graph)
    runtime.attach_strategy(model, graph, strategy)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, (x, y), strategy


def recorded_rows(model, batch):
    executor = model.strategy_executor
    assert isinstance(executor, model_step.ModelStepExecutor), executor
    return realized.check(realized.record(executor, batch), executor.plans)


def assert_as_planned(test, model, batch, strategy):
    rows = recorded_rows(model, batch)
    table = realized.format_table(rows)
    test.assertEqual([r for r in rows if not r.ok], [],
                     f"{dict(strategy)}\n{table}")
    # Every op was recorded, with its inputs and outputs.
    for plan in model.strategy_executor.plans:
        kinds = {r.kind for r in rows if r.op == plan.op.name}
        test.assertLessEqual({"input", "output"}, kinds, plan.op.name)
        if plan.op.weights:
            test.assertIn("weight", kinds, plan.op.name)
    return rows


def check_model(test, name, seeds, draw=random_one_mesh):
    split = False
    for seed in seeds:
        with test.subTest(model=name, seed=seed, draw=draw.__name__):
            model, batch, strategy = one_step(MODELS[name], draw(seed))
            if all(c.device_ids == (0,) for c in strategy.values()):
                # Keras's own step on device 0: no DTensor to read.
                test.assertIsNotNone(model.strategy_executor.single_device)
                continue
            assert_as_planned(test, model, batch, strategy)
            split = True
    test.assertTrue(split, f"{name}: no drawn strategy split anything")


def random_on_mesh(seed, shape=(2, 2)):
    """Random configs on an N-D mesh (`mesh_space`, which the search
    also gives models that run their own step), one op on two axes
    where one can be."""

    def make(graph):
        rng, mesh = random.Random(seed), MeshSpec.first(shape)
        configs = {op.name: rng.choice(mesh_space.mesh_configs(op, mesh))
                   for op in graph}
        wide = [(op, c) for op in graph
                for c in mesh_space.mesh_configs(op, mesh)
                if sum(g > 1 for g in c.dims) >= 2]
        if wide:
            op, config = rng.choice(wide)
            configs[op.name] = config
        return search_space.tie_shared(graph, Strategy(configs))[0]

    return make


def sequence_splits(graph):
    """Every op with a sequence dim splits it over the 4 devices (else
    its first one-mesh config)."""
    configs = {}
    for op in graph:
        choices = search_space.one_mesh_configs(op, DEVICES)
        sequence = [c for c in choices
                    if len(c.dims) == 3 and c.dims[1] == DEVICES]
        configs[op.name] = (sequence or choices)[0]
    return Strategy(configs)


class RealizedLayoutsTest(unittest.TestCase):
    def test_random_strategies(self):
        for name in MODELS:
            check_model(self, name, seeds=(1,))

    @pytest.mark.slow  # about 100 s on 2 cores, seed 1 about 20 s
    def test_random_strategies_second_seed(self):
        for name in MODELS:
            check_model(self, name, seeds=(2,))

    def test_random_strategies_on_a_2x2_mesh(self):
        for name in ("self_attention", "shared_layer"):
            check_model(self, name, seeds=(1,), draw=random_on_mesh)

    def test_self_attention_query_keeps_its_sequence_split(self):
        # `mha(x, x)`: one tensor is the query (split on the sequence
        # under an Attribute split) and the value (whole). Relaid by
        # tensor rather than by position, the query came in replicated.
        model, batch, strategy = one_step(build_attention, sequence_splits)
        self.assertEqual(strategy["attention"].dims, (1, DEVICES, 1))
        rows = assert_as_planned(self, model, batch, strategy)
        layouts = {r.tensor: realized.format_layout(r.realized)
                   for r in rows if r.op == "attention"}
        self.assertEqual(layouts["input 0"], "[-, a0, -]")
        self.assertEqual(layouts["input 1"], "[-, -, -]")

    def test_keyword_attention_splits_its_query(self):
        # `mha(query=q, value=v, key=k)`: the query is input 1, and it
        # is the input the sequence split follows.
        model, batch, strategy = one_step(build_keyword_attention,
                                          sequence_splits)
        self.assertEqual(strategy["attention"].dims, (1, DEVICES, 1))
        rows = assert_as_planned(self, model, batch, strategy)
        layouts = {r.tensor: realized.format_layout(r.realized)
                   for r in rows if r.op == "attention"}
        self.assertEqual(layouts["input 1"], "[-, a0, -]")  # query
        self.assertEqual(layouts["input 0"], "[-, -, -]")  # key
        self.assertEqual(layouts["input 2"], "[-, -, -]")  # value

    def test_check_fails_without_the_layer_hook(self):
        # Keras's own `Operation.__call__` back: no relayouts. The batch
        # comes in replicated, so the first op's input and everything
        # computed from it stay replicated where the plan splits them.
        model, batch, strategy = one_step(
            build_mlp, lambda g: search_space.one_mesh_data_parallel(
                g, DEVICES)
        )
        with mock.patch.object(Operation, "__call__", model_step._KERAS_CALL):
            rows = recorded_rows(model, batch)
        bad = {(r.op, r.tensor) for r in rows if not r.ok}
        self.assertIn(("dense_0", "input 0"), bad,
                      realized.format_table(rows))
        self.assertIn(("logits", "output 0"), bad)
        first = next(r for r in rows if (r.op, r.tensor)
                     == ("dense_0", "input 0"))
        self.assertEqual(realized.format_layout(first.planned), "[a0, -]")
        self.assertEqual(realized.format_layout(first.realized), "[-, -]")
        # With the hook back, the same model checks out.
        assert_as_planned(self, model, batch, strategy)

    def test_check_fails_when_call_op_skips_relayouts(self):
        def keras_call(self, operation, args, kwargs):
            return model_step._KERAS_CALL(operation, *args, **kwargs)

        model, batch, _ = one_step(
            build_embedding, lambda g: search_space.one_mesh_data_parallel(
                g, DEVICES)
        )
        with mock.patch.object(model_step.ModelStepExecutor, "call_op",
                               keras_call):
            rows = recorded_rows(model, batch)
        self.assertTrue([r for r in rows if not r.ok and r.kind == "input"],
                        realized.format_table(rows))

    def test_missing_call_is_a_mismatch(self):
        model, batch, _ = one_step(build_mlp, random_one_mesh(1))
        executor = model.strategy_executor
        recorded = [e for e in realized.record(executor, batch)
                    if e.op != "logits"]
        bad = realized.mismatches(recorded, executor.plans)
        self.assertEqual([(r.op, r.kind, r.ok) for r in bad],
                         [("logits", "call", False)])

    def test_recording_leaves_training_unchanged(self):
        make = random_one_mesh(1)
        histories, weights = [], []
        for record in (False, True):
            model, (x, y), _ = one_step(build_own_step, make)
            if record:
                recorded_rows(model, (x, y))
            history = model.fit(x, y, batch_size=BATCH, epochs=2,
                                shuffle=False, verbose=0).history
            histories.append(history["loss"])
            weights.append(model.get_weights() + [
                v.numpy() for v in model.optimizer.variables
            ])
        np.testing.assert_array_equal(histories[0], histories[1])
        for a, b in zip(*weights):
            np.testing.assert_array_equal(a, b)

    def test_show_layouts_prints_once(self):
        out = io.StringIO()
        keras.utils.set_random_seed(0)
        model, (x, y) = build_shared()
        graph = build_graph(model, BATCH)
        runtime.attach_strategy(model, graph, random_one_mesh(2)(graph))
        with mock.patch.dict(os.environ,
                             {"FLEXFLOW_KERAS_SHOW_LAYOUTS": "1"}), \
                contextlib.redirect_stdout(out):
            model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                      verbose=0)
        text = out.getvalue()
        self.assertEqual(text.count("layouts in the train step"), 1, text)
        self.assertIn("every op ran as planned", text)
        for op in ("shared", "shared#1", "add", "head"):
            self.assertIn(f"\n{op} ", text)

    def test_show_layouts_is_off_by_default(self):
        out = io.StringIO()
        with mock.patch.dict(os.environ,
                             {"FLEXFLOW_KERAS_SHOW_LAYOUTS": ""}), \
                contextlib.redirect_stdout(out):
            one_step(build_mlp, random_one_mesh(1))
        self.assertNotIn("layouts in the train step", out.getvalue())

    def test_show_layouts_setting(self):
        self.assertFalse(settings.show_layouts({}))
        self.assertTrue(settings.show_layouts(
            {"FLEXFLOW_KERAS_SHOW_LAYOUTS": "1"}))
        self.assertFalse(settings.show_layouts(
            {"FLEXFLOW_KERAS_SHOW_LAYOUTS": "off"}))
        with self.assertRaisesRegex(ValueError, "SHOW_LAYOUTS"):
            settings.show_layouts({"FLEXFLOW_KERAS_SHOW_LAYOUTS": "maybe"})


@pytest.mark.slow
class RealizedLayoutsSlowTest(unittest.TestCase):
    def test_many_random_strategies(self):
        for name in MODELS:
            check_model(self, name, seeds=range(3, 11))

    def test_many_random_strategies_on_a_2x2_mesh(self):
        for name in MODELS:
            check_model(self, name, seeds=range(2, 6), draw=random_on_mesh)
