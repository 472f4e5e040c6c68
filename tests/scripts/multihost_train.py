"""Trains a small model 3 epochs and saves losses and weights: run alone
(4 virtual CPU devices) or once per host under flexflow_keras.launch.

    python tests/scripts/multihost_train.py {mlp,two_input,own_step} OUT_DIR
        [--die-at-batch N] [--differ] [the package's flags: --import, --budget ...]

Writes OUT_DIR/<client>.npz (client: DTENSOR_CLIENT_ID, or "solo") with
the loss history and the final weights. With --die-at-batch, client 1
kills itself (SIGKILL) at that batch of the second epoch; with
--differ, client 1 starts from other weights than client 0.
"""

import argparse
import os
import signal

import numpy as np

import flexflow_keras as keras


class OwnStep(keras.Model):
    """The train step of keras.io's "customizing what happens in fit"."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def build(kind):
    if kind in ("mlp", "own_step"):
        own = kind == "own_step"
        extra = dict(kernel_regularizer=keras.regularizers.L2(0.01)) \
            if own else {}
        inputs = keras.Input(shape=(32,), name="x")
        h = keras.layers.Dense(64, activation="relu", name="d0",
                               **extra)(inputs)
        h = keras.layers.Dense(64, activation="relu", name="d1", **extra)(h)
        outputs = keras.layers.Dense(4, name="d2", **extra)(h)
        return (OwnStep if own else keras.Model)(inputs, outputs)
    a = keras.Input(shape=(32,), name="a")
    b = keras.Input(shape=(16,), name="b")
    ha = keras.layers.Dense(32, activation="relu", name="da")(a)
    hb = keras.layers.Dense(32, activation="relu", name="db")(b)
    h = keras.layers.Concatenate(name="cat")([ha, hb])
    return keras.Model([a, b], keras.layers.Dense(4, name="out")(h))


class DieAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch, self.epoch = batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == self.batch:
            print("client 1 dies now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["mlp", "two_input", "own_step"])
    parser.add_argument("out")
    parser.add_argument("--die-at-batch", type=int, default=None)
    parser.add_argument("--input", default="numpy",
                        choices=["numpy", "dataset", "generator"],
                        help="How fit() gets the data.")
    parser.add_argument("--differ", action="store_true",
                        help="Client 1 starts from other weights.")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(256, 32)).astype("float32")]
    if args.kind == "two_input":
        x.append(rng.normal(size=(256, 16)).astype("float32"))
    y = rng.integers(0, 4, size=(256,))
    model = build(args.kind)
    model.set_weights([
        np.random.default_rng(i).normal(scale=0.1, size=w.shape)
        .astype("float32") for i, w in enumerate(model.get_weights())
    ])
    client = os.environ.get("DTENSOR_CLIENT_ID", "solo")
    if args.differ and client == "1":
        weights = model.get_weights()
        model.set_weights([weights[0] + 1.0, *weights[1:]])
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = []
    if args.die_at_batch is not None and client == "1":
        callbacks.append(DieAt(args.die_at_batch))
    features = tuple(x) if len(x) > 1 else x[0]
    if args.input == "numpy":
        data = dict(x=features, y=y, batch_size=64, shuffle=False)
    elif args.input == "dataset":
        import tensorflow as tf

        data = dict(x=tf.data.Dataset.from_tensor_slices(
            (features, y)).batch(64))
    else:
        def batches():  # endless: fit() takes 4 per epoch
            while True:
                for start in range(0, 256, 64):
                    rows = slice(start, start + 64)
                    if isinstance(features, tuple):
                        yield tuple(f[rows] for f in features), y[rows]
                    else:
                        yield features[rows], y[rows]

        data = dict(x=batches(), steps_per_epoch=4)
    history = model.fit(**data, epochs=3, verbose=0, callbacks=callbacks)
    print("strategy:", model.strategy.to_text().replace("\n", " | "))
    print("losses:", history.history["loss"])
    executor = model.strategy_executor
    mesh = getattr(executor, "mesh", None)
    print("executor:", type(executor).__name__, "mesh:",
          "none" if mesh is None else
          "x".join(str(mesh.dim_size(n)) for n in mesh.dim_names))
    np.savez(os.path.join(args.out, f"{client}.npz"),
             losses=np.array(history.history["loss"]),
             *model.get_weights())


if __name__ == "__main__":
    main()
