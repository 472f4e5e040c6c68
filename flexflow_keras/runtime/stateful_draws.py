"""TensorFlow's stateful random ops in a DTensor step, drawing what
plain Keras draws.

Why: DTensor refuses TensorFlow's stateful random ops
(`RandomStandardNormal`, `RandomUniform`, `RandomUniformInt`,
`TruncatedNormal`: `tf.random.normal/uniform/truncated_normal` and
`tf.nn.dropout` in a script's own step, as in keras.io's VAE, WGAN-GP
and DCGAN). Such an op draws from a Philox generator whose key is its
`seed` attribute and whose counter starts at its `seed2` in the upper
64 bits; each run takes the next `256 x (elements drawn)` counter values
(`GuardedPhiloxRandom::ReserveRandomOutputs`), and the generator lives
as long as the kernel, the function Keras traced its step into. Its
stateless twin with an explicit key and counter
(`StatelessRandomNormalV2` and the like, Philox) fills its output the
same way, so it gives the same values bit for bit when handed that key
and counter (measured on TensorFlow 2.21, three runs of four ops, one
of another batch size).

So, while a step is traced (`drawing`), the raw op wrappers in
`gen_random_ops`, which `tf.random.*` calls with the seeds
`random_seed.get_seed` gave (the graph-level seed and the op's index
among the graph's draws, as in plain Keras's trace), emit the stateless
twin. Each draw's counter is a slot of an int64 vector (a
`deferred.StepVariable` on the mesh: written at the step's end), one
slot per draw in trace order and per step kind, as plain Keras has one
kernel per op and per traced function (train, test, predict), which
serves every batch size. A draw without seeds (no global seed set: its
kernel would pick a random key) takes the executor's own key.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import gen_random_ops

from flexflow_keras.runtime import op_rules

# Draws each step kind has slots for; a step with more shares them
# round (each draw keeps its own seeds, so streams stay distinct).
SLOTS_PER_KIND = 64
KINDS = ("train", "test", "predict")
SLOTS = SLOTS_PER_KIND * len(KINDS)
# `GuardedPhiloxRandom::ReserveRandomOutputs`'s multiplier: counter
# values a run takes per element drawn.
_COUNTER_PER_ELEMENT = 256
_PHILOX = 1  # `Algorithm.PHILOX`


@contextlib.contextmanager
def drawing(counters: Any, mesh: Any, kind: str,
            unseeded_key: int) -> Iterator[None]:
    """While a step of `kind` is traced: stateful draws run as their
    stateless twins, with the key and counter the stateful op's
    generator would have (see the module docstring). `counters`: an
    int64 vector of `SLOTS` on `mesh`, replicated."""
    first = KINDS.index(kind) * SLOTS_PER_KIND
    drawn = [0]  # draws traced so far in this trace

    def draw(stateless: Any, shape: Any, seed: int, seed2: int,
             **arguments: Any) -> tf.Tensor:
        slot = first + drawn[0] % SLOTS_PER_KIND
        drawn[0] += 1
        if not seed and not seed2:  # unseeded: the kernel's own key
            seed, seed2 = unseeded_key, slot
        counter = tf.stack([
            tf.cast(counters.read_value()[slot], tf.uint64),
            tf.constant(seed2 % 2**64, tf.uint64),
        ])
        # Whole on every device, as every draw in a step
        # (`op_rules.replicated_draw`).
        value = op_rules.replicated_draw(stateless, mesh)(
            shape=shape, key=tf.constant([seed % 2**64], tf.uint64),
            counter=counter, alg=_PHILOX, **arguments)
        taken = tf.size(value, out_type=tf.int64) * _COUNTER_PER_ELEMENT
        counters.assign_add(tf.scatter_nd([[slot]], [taken], [SLOTS]))
        return value

    # `gen_random_ops`'s wrappers, with their signatures.
    def random_standard_normal(shape, dtype, seed=0, seed2=0, name=None):
        return draw(tf.raw_ops.StatelessRandomNormalV2, shape, seed, seed2,
                    dtype=dtype, name=name)

    def random_uniform(shape, dtype, seed=0, seed2=0, name=None):
        return draw(tf.raw_ops.StatelessRandomUniformV2, shape, seed,
                    seed2, dtype=dtype, name=name)

    def truncated_normal(shape, dtype, seed=0, seed2=0, name=None):
        return draw(tf.raw_ops.StatelessTruncatedNormalV2, shape, seed,
                    seed2, dtype=dtype, name=name)

    def random_uniform_int(shape, minval, maxval, seed=0, seed2=0,
                           name=None):
        return draw(tf.raw_ops.StatelessRandomUniformIntV2, shape, seed,
                    seed2, minval=minval, maxval=maxval, name=name)

    twins = {"random_standard_normal": random_standard_normal,
             "random_uniform": random_uniform,
             "truncated_normal": truncated_normal,
             "random_uniform_int": random_uniform_int}
    replaced = {name: getattr(gen_random_ops, name) for name in twins}
    for name, twin in twins.items():
        setattr(gen_random_ops, name, twin)
    try:
        yield
    finally:
        for name, function in replaced.items():
            setattr(gen_random_ops, name, function)
