"""A step that fails on the user's data leaves the model able to train.

A label outside the classes or an embedding id past the table fails a
step while it runs, in plain Keras as under a strategy. The script gets
the error; once the data is mended, the next fit must train the model as
plain Keras trains it, from the weights trained before the error. Before,
DTensor's asynchronous device cancelled every later op (the next fit, even
the copy of the trained weights back to Keras, raised `CancelledError`),
and a failure in the first step sent the model to plain Keras for good.

Where the failing step's devices were waiting in a collective, TensorFlow
aborts those collectives for the rest of the process ("Restart your
program to reset"): the model then goes on as plain Keras, saying so. That
would spoil every later test in the same process, so the cases run in a
child process of their own.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROWS, BATCH, IDS, CLASSES = 64, 16, 20, 3


def _model(mod):
    ids = mod.Input((4,), dtype="int32")
    x = mod.layers.Embedding(IDS, 8)(ids)
    x = mod.layers.Flatten()(x)
    x = mod.layers.Dense(16, activation="relu")(x)
    return mod.Model(ids, mod.layers.Dense(CLASSES)(x))


def _data():
    rng = np.random.default_rng(5)
    return (rng.integers(0, IDS, (ROWS, 4)).astype("int32"),
            rng.integers(0, CLASSES, (ROWS,)).astype("int32"))


def _labels(rows):
    def spoil(x, y):
        y[rows] = CLASSES + 4
        return x, y
    return spoil


def _embedding_id(row):
    def spoil(x, y):
        x[row, 2] = IDS + 5
        return x, y
    return spoil


# name -> (spoiled data, what the error says). Whether a failure aborts
# the devices' collectives depends on timing, even where every device
# fails (measured: "every label of the first batch" kept its strategy in
# 4 runs of its own and left it in one CI run).
CASES = {
    "every label of the first batch": (_labels(slice(0, BATCH)),
                                       "label value of 7"),
    "one label in the first batch": (_labels(3), "label value of 7"),
    "one label in a later batch": (_labels(40), "label value of 7"),
    "an embedding id in a later batch": (_embedding_id(50), "25 is not in"),
}


def _run(mod, spoil, make_strategy=None):
    """Fits once on spoiled data (expected to fail), then twice on the
    mended data. Returns (model, the failure's message, whether the model
    kept its strategy after the failure, the mended fit's history)."""
    import keras

    from flexflow_keras.keras_graph import build_graph
    from flexflow_keras.strategy_files import save_strategy

    x, y = _data()
    bad_x, bad_y = spoil(x.copy(), y.copy())
    keras.utils.set_random_seed(3)
    model = _model(mod)
    options = {}
    with tempfile.TemporaryDirectory() as folder:
        if make_strategy is not None:
            options["import_strategy"] = os.path.join(folder, "s.txt")
            save_strategy(make_strategy(build_graph(model, BATCH)),
                          options["import_strategy"])
        # SGD: a failed step that bumped Keras's iteration count (plain
        # Keras's graph may run that increment before the loss fails)
        # changes no update.
        model.compile(
            optimizer=mod.optimizers.SGD(0.05, momentum=0.9),
            loss=mod.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], **options)
        failure = None
        try:
            model.fit(bad_x, bad_y, batch_size=BATCH, epochs=1,
                      shuffle=False, verbose=0)
        except Exception as error:  # noqa: BLE001 - compared below
            failure = str(error)
        kept = getattr(model, "strategy_executor", None) is not None
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0).history
    return model, failure, kept, history


def child_main() -> None:
    """Runs every case, plain and under each strategy; prints one JSON
    line of what the parent checks."""
    import warnings

    import keras

    import flexflow_keras as fk
    import runtime_support as support

    strategies = {"one mesh": support.data_parallel,
                  "several meshes": support.several_meshes}
    results = []
    for case, (spoil, says) in CASES.items():
        plain, plain_failure, _, plain_history = _run(keras, spoil)
        for name, make in strategies.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ours, failure, kept, history = _run(fk, spoil, make)
            gaps = [
                float(np.max(np.abs(np.subtract(history[k], v))
                             / (np.abs(v) + 1e-6)))
                for k, v in plain_history.items()
            ] + [
                support.relative_error(b, a)
                for a, b in zip(plain.get_weights(), ours.get_weights())
            ]
            results.append({
                "case": case, "strategy": name,
                "plain_says": says in (plain_failure or ""),
                "ours_says": says in (failure or ""),
                "kept": kept,
                "at_end": ours.strategy_executor is not None,
                "told": [str(w.message) for w in caught
                         if "plain Keras" in str(w.message)],
                "gap": max(gaps),
            })
    print(json.dumps(results))


class FailedStepTest(unittest.TestCase):
    def test_the_error_is_raised_and_the_mended_data_trains_as_plain_keras(
            self):
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, FLEXFLOW_KERAS_CPU_DEVICES="4",
                   TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(
            [here, os.path.join(os.path.dirname(here), "bench")]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        done = subprocess.run(
            [sys.executable, "-c",
             "import test_failed_steps; test_failed_steps.child_main()"],
            env=env, capture_output=True, text=True, timeout=600,
        )
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        results = json.loads(done.stdout.strip().splitlines()[-1])
        self.assertEqual(len(results), 2 * len(CASES))
        for got in results:
            with self.subTest(case=got["case"], strategy=got["strategy"]):
                self.assertTrue(got["plain_says"])
                self.assertTrue(got["ours_says"])
                # The user's error is no reason to leave the strategy,
                # and the mended data trains as in plain Keras.
                self.assertLess(got["gap"], 1e-5)
                if got["at_end"]:
                    self.assertEqual(got["told"], [])
                else:  # collectives aborted by TensorFlow: said, once
                    self.assertEqual(len(got["told"]), 1, got["told"])
                    self.assertIn("Restart the script", got["told"][0])


class InterruptedFitTest(unittest.TestCase):
    def test_a_fit_stopped_by_ctrl_c_leaves_the_trained_weights(self):
        """KeyboardInterrupt (Ctrl-C in a notebook) mid-fit: the layers'
        variables, read directly, hold what the steps before it trained,
        as in plain Keras."""
        import keras

        import flexflow_keras as fk

        class Stop(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 2:
                    raise KeyboardInterrupt

        x, y = _data()
        read = {}
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(3)
            model = _model(mod)
            model.compile(optimizer=mod.optimizers.SGD(0.05, momentum=0.9),
                          loss=mod.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
            with self.assertRaises(KeyboardInterrupt):
                model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                          verbose=0, callbacks=[Stop()])
            if mod is fk:
                self.assertIsNotNone(model.strategy_executor)
            read[name] = [np.array(v.numpy()) for v in model.weights]
        for a, b in zip(read["plain"], read["ours"]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    unittest.main()
