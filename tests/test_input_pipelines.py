"""The pipelines Keras builds for a flexflow_keras model's fit run without
tf.data's autotuning thread (`runtime/input_pipelines.py`: destroying an
epoch's iterator waited out that thread's sleep, up to tens of seconds at
an epoch's start); a user's own `tf.data.Dataset` and a plain Keras
model's pipelines are left as built, and training equals plain Keras's.
"""

import unittest
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import (
    array_data_adapter, generator_data_adapter, tf_dataset_adapter,
)

import flexflow_keras as fk

SAMPLES, BATCH = 64, 16


def _build(mod):
    inputs = mod.Input((8,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = mod.layers.Dense(4, name="out")(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", search_budget=0) \
        if mod is fk else model.compile(optimizer="adam", loss="mse")
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(SAMPLES, 8)).astype("float32"),
            rng.normal(size=(SAMPLES, 4)).astype("float32"))


def _generator(x, y):
    def batches():
        while True:
            for start in range(0, SAMPLES, BATCH):
                yield x[start:start + BATCH], y[start:start + BATCH]
    return batches()


class _Recorded:
    """Records the autotune option of every dataset an adapter builds."""

    def __init__(self, adapter):
        self.adapter, self.seen = adapter, []

    def __enter__(self):
        real = self.adapter.get_tf_dataset

        def recording(adapter_self):
            dataset = real(adapter_self)
            self.seen.append(dataset.options().autotune.enabled)
            return dataset

        self._patch = mock.patch.object(self.adapter, "get_tf_dataset",
                                        recording)
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


class InputPipelinesTest(unittest.TestCase):
    def test_arrays_fit_untuned_and_equal_plain_keras(self):
        x, y = _data()
        xv, yv = _data(1)
        results = []
        for mod in (keras, fk):
            keras.utils.set_random_seed(3)
            model = _build(mod)
            with _Recorded(array_data_adapter.ArrayDataAdapter) as rec:
                history = model.fit(x, y, batch_size=BATCH, epochs=3,
                                    validation_data=(xv, yv), verbose=0)
                model.evaluate(xv, yv, verbose=0)
                model.predict(xv, verbose=0)
            results.append((history.history, model.get_weights(), rec.seen))
        (plain_hist, plain_w, plain_seen), (ours_hist, ours_w, ours_seen) = (
            results)
        # fit's training and validation data, evaluate's and predict's
        self.assertGreaterEqual(len(ours_seen), 4)
        self.assertEqual(set(ours_seen), {False})
        self.assertNotIn(False, plain_seen)  # plain Keras left as built
        for key in plain_hist:
            np.testing.assert_allclose(ours_hist[key], plain_hist[key],
                                       rtol=1e-5)
        for a, b in zip(plain_w, ours_w):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)

    def test_generator_fit_untuned(self):
        x, y = _data()
        keras.utils.set_random_seed(3)
        model = _build(fk)
        with _Recorded(generator_data_adapter.GeneratorDataAdapter) as rec:
            model.fit(_generator(x, y), steps_per_epoch=SAMPLES // BATCH,
                      epochs=2, verbose=0)
        self.assertTrue(rec.seen)
        self.assertEqual(set(rec.seen), {False})

    def test_users_own_dataset_is_left_as_built(self):
        x, y = _data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        keras.utils.set_random_seed(3)
        model = _build(fk)
        with _Recorded(tf_dataset_adapter.TFDatasetAdapter) as rec:
            model.fit(dataset, epochs=2, verbose=0)
        self.assertTrue(rec.seen)
        self.assertNotIn(False, rec.seen)

    def test_outside_a_fit_nothing_changes(self):
        x, y = _data()
        adapter = array_data_adapter.ArrayDataAdapter(x, y, batch_size=BATCH)
        self.assertIsNot(adapter.get_tf_dataset().options().autotune.enabled,
                         False)


if __name__ == "__main__":
    unittest.main()
