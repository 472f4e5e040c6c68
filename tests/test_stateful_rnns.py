"""Stateful recurrent layers (`stateful=True`) train as on plain Keras.

Such a layer carries its last state from one batch to the next in
variables the model does not track (`RNN.states`, made outside Keras's
tracking) and writes them at every call, whatever `training` is. Two
silent wrong results came from that:
- measuring the layer's cost on a new machine ran it and left the
  measurement's state there, so training started from it rather than from
  zeros (`user_random.kept` now puts back every variable the package's
  work wrote);
- the layer-by-layer step (strategies over several meshes) carries only
  tracked state, so each batch started from zeros again (a stateful
  layer is now a reason for the model's own step, `own_step_reasons`).
"""

import os
import tempfile
import unittest

import keras
import numpy as np

import flexflow_keras as fk
import runtime_support
from flexflow_keras import runtime
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy_files import save_strategy

BATCH = 16


def _stateful(mod):
    """Stacked stateful RNNs."""
    inputs = mod.Input(batch_shape=(BATCH, 5, 3))
    h = mod.layers.LSTM(8, stateful=True, return_sequences=True)(inputs)
    h = mod.layers.GRU(4, stateful=True)(h)
    return mod.Model(inputs, mod.layers.Dense(2)(h))


def _data():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(48, 5, 3)).astype("float32"),
            rng.normal(size=(48, 2)).astype("float32"))


class ResetAtEpochEnd(keras.callbacks.Callback):
    """As Keras's docs do: the first epoch starts from the state the
    layers were built with."""

    def on_epoch_end(self, epoch, logs=None):
        for layer in self.model.layers:
            if getattr(layer, "stateful", False):
                layer.reset_states()


def _states(model):
    return [v.numpy() for layer in model.layers
            for v in (getattr(layer, "states", None) or ())]


class StatefulRecurrentTest(unittest.TestCase):
    def _train_both(self, strategy_path=None):
        x, y = _data()

        def train(model):
            options = {}
            if strategy_path is not None and isinstance(model, fk.Model):
                save_strategy(runtime_support.several_meshes(
                    build_graph(model, BATCH)), strategy_path)
                options["import_strategy"] = strategy_path
            model.compile(optimizer="adam", loss="mse", **options)
            history = model.fit(x, y, batch_size=BATCH, epochs=2,
                                shuffle=False, verbose=0,
                                callbacks=[ResetAtEpochEnd()])
            return history.history

        runs = runtime_support.train_plain_and_ours(_stateful, 5, train)
        ours = runs["ours"][0]
        runtime_support.assert_own_step_under_strategy(self, runs)
        devices = {d for c in ours.strategy.values() for d in c.device_ids}
        self.assertGreater(len(devices), 1)
        runtime_support.assert_same_runs(self, runs)
        for run in runs.values():
            states = _states(run[0])
            self.assertEqual(len(states), 3)  # LSTM's h and c; GRU's h
            for state in states:
                np.testing.assert_array_equal(state, 0.0)  # reset
        predictions = [run[0].predict(x[:32], batch_size=BATCH, verbose=0)
                       for run in runs.values()]
        np.testing.assert_allclose(*predictions, rtol=1e-5, atol=1e-6)
        return runs

    def test_stateful_rnns_start_from_zeros_and_carry_state(self):
        # Nothing measured yet, as on a new user's first run.
        runtime_support.fresh_caches(self)
        self._train_both()

    def test_a_several_mesh_strategy_gives_way_to_one_mesh(self):
        with tempfile.TemporaryDirectory() as folder:
            runs = self._train_both(os.path.join(folder, "strategy.txt"))
        ours, _, _ = runs["ours"]
        self.assertTrue(runtime_support.on_one_mesh(ours), ours.strategy)
        self.assertEqual(runtime.own_step_reasons(ours), [
            f"layer '{ours.layers[1].name}' is stateful",
            f"layer '{ours.layers[2].name}' is stateful",
        ])


if __name__ == "__main__":
    unittest.main()
