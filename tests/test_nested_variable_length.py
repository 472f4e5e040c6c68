"""A model whose nested models take variable-length inputs
(`keras.Input((None,))`, keras.io's encoder-decoder Transformer) is
planned on the shapes `fit` feeds and trains under its strategy, equal
to plain Keras (it stopped at planning: "Tensor of 'functional_3/
positional_embedding_1' has an unknown dimension").
"""

import unittest
import warnings

import keras
import numpy as np

import flexflow_keras as fk
from flexflow_keras.runtime import model_step

ROWS, BATCH, LENGTH, VOCAB = 64, 16, 6, 30


def build(mod):
    """An encoder and a decoder model, each on `Input((None,))` tokens,
    called by an outer model whose inputs are variable-length too (the
    decoder's second input a sequence of the encoder's features)."""
    tokens = mod.Input((None,), dtype="int64", name="enc_tokens")
    h = mod.layers.Embedding(VOCAB, 8, name="enc_emb")(tokens)
    h = mod.layers.Dense(8, activation="relu", name="enc_dense")(h)
    encoder = mod.Model(tokens, h, name="encoder")

    dec_tokens = mod.Input((None,), dtype="int64", name="dec_tokens")
    features = mod.Input((None, 8), name="features")
    d = mod.layers.Embedding(VOCAB, 8, name="dec_emb")(dec_tokens)
    d = mod.layers.Attention(name="cross")([d, features])
    d = mod.layers.Dense(VOCAB, name="dec_out")(d)
    decoder = mod.Model([dec_tokens, features], d, name="decoder")

    enc_in = mod.Input((None,), dtype="int64", name="source")
    dec_in = mod.Input((None,), dtype="int64", name="target")
    outputs = decoder([dec_in, encoder(enc_in)])
    model = mod.Model({"source": enc_in, "target": dec_in}, outputs)
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="rmsprop",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), **options)
    return model


def data():
    rng = np.random.default_rng(0)
    source = rng.integers(1, VOCAB, (ROWS, LENGTH))
    target = rng.integers(1, VOCAB, (ROWS, LENGTH))
    return {"source": source, "target": target}, np.roll(target, -1, 1)


class NestedVariableLengthTest(unittest.TestCase):
    def test_trains_under_its_strategy_equal_to_plain_keras(self):
        x, y = data()
        results = {}
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(5)
            model = build(mod)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                history = model.fit(x, y, batch_size=BATCH, epochs=2,
                                    shuffle=False, verbose=0).history
            results[name] = (model, history, caught)
        ours, history, caught = results["ours"]
        messages = [str(w.message) for w in caught]
        self.assertFalse([m for m in messages if "plain Keras" in m],
                         messages)
        # Nor a warning about the names of the trace's own inputs.
        self.assertFalse([m for m in messages if "as a dict" in m],
                         messages)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)
        graph = ours.plan.graph
        # The nested models' layers are ops, on the fed shapes.
        self.assertEqual(graph.op("encoder/enc_emb").output_shapes[0],
                         (BATCH, LENGTH, 8))
        self.assertEqual(graph.op("decoder/dec_out").output_shapes[0],
                         (BATCH, LENGTH, VOCAB))
        plain, plain_history, _ = results["plain"]
        np.testing.assert_allclose(history["loss"], plain_history["loss"],
                                   rtol=1e-5)
        for a, b in zip(plain.get_weights(), ours.get_weights()):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    unittest.main()
