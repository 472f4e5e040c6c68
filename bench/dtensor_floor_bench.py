"""The floor under any DTensor runtime: a hand-written data-parallel
step with nothing of Keras around it.

The bench MLP's shapes (256 -> 512 -> 512 -> 10, batch 64) on the
attached devices (4 virtual CPU devices without GPUs), weights
replicated and the batch split, in one `tf.function` per variant:
gradients only, SGD, Adam (replicated moments) and Adam with moments
sharded ZeRO-style (the update all-gathered back). Prints ms per step;
compare with `runtime_bench.py`'s Keras-on-JAX figure for the MLP.

Usage:
    python bench/dtensor_floor_bench.py [--steps 50] [--jit]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import flexflow_keras  # noqa: E402,F401  (devices first)
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from flexflow_keras import devices  # noqa: E402

SHAPES = [(256, 512), (512, 512), (512, 10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--jit", action="store_true",
                        help="jit_compile=True on each step function.")
    args = parser.parse_args()
    names = list(devices.device_names())
    n = len(names)
    mesh = dtensor.create_mesh([("batch", n)], devices=names)
    rep = dtensor.Layout.replicated(mesh, 2)
    split = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)

    def variables(layout_of):
        return [dtensor.DVariable(dtensor.call_with_layout(
            tf.zeros, layout_of(s), s)) for s in SHAPES]

    weights = [dtensor.DVariable(dtensor.call_with_layout(
        tf.fill, rep, s, 0.01)) for s in SHAPES]
    x = dtensor.call_with_layout(tf.ones, split, (64, 256))

    def grads(x):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ weights[0])
            h = tf.nn.relu(h @ weights[1])
            loss = tf.reduce_mean(tf.square(h @ weights[2]))
        return loss, tape.gradient(loss, weights)

    def sgd(x):
        loss, gs = grads(x)
        for w, g in zip(weights, gs):
            w.assign_sub(0.01 * g)
        return loss

    def adam_with(ms, vs, layout_of):
        def step(x):
            loss, gs = grads(x)
            for w, m, v, g, s in zip(weights, ms, vs, gs, SHAPES):
                g = dtensor.relayout(g, layout_of(s))
                m.assign(0.9 * m + 0.1 * g)
                v.assign(0.999 * v + 0.001 * g * g)
                update = 0.001 * m / (tf.sqrt(v) + 1e-7)
                w.assign_sub(dtensor.relayout(update, rep))
            return loss
        return step

    def sharded(s):
        return split if s[0] % n == 0 else rep

    variants = {  # each returns the loss first; what it returns is run
        "gradients only": grads,
        "sgd": sgd,
        "adam": adam_with(variables(lambda s: rep),
                          variables(lambda s: rep), lambda s: rep),
        "adam, sharded moments": adam_with(
            variables(sharded), variables(sharded), sharded),
    }
    print(f"{n} x {devices.device_kind()}, MLP {SHAPES}, batch 64, "
          f"jit_compile={args.jit}: ms per step")
    for name, fn in variants.items():
        step = tf.function(fn, jit_compile=args.jit, autograph=False)
        for _ in range(3):
            loss = tf.nest.flatten(step(x))[0]
            dtensor.unpack(loss)[0].numpy()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = tf.nest.flatten(step(x))[0]
        dtensor.unpack(loss)[0].numpy()
        ms = (time.perf_counter() - start) * 1e3 / args.steps
        print(f"  {name:<24}{ms:8.2f}", flush=True)


if __name__ == "__main__":
    main()
