"""The user's random streams stay the user's.

A script seeded with `keras.utils.set_random_seed` draws the same data,
initial weights and noise on plain Keras and on this package only if the
package's own work (tracing the model, probing layers, measuring op
costs, the search, building executors) takes nothing from the streams the
script draws from. It took from all of them (measured after one compile
and fit: Python's `random`, NumPy's global generator, TensorFlow's eager
op seeds and so Keras's initializers differed from plain Keras's), so a
second model built after a fit started from other weights: keras.io's
`endpoint_layer_pattern.py` trained its subclassed model to 0.3477
against plain Keras's 0.3487.

`kept()` saves those streams and puts them back when the package's work
is done: Python's `random` (Keras's default seeds come from it), NumPy's
global state, TensorFlow's eager op-seed generator (`tf.random.*`
without a seed, once a global seed is set), its global `Generator` if
one exists, Keras's global `SeedGenerator` (`keras.random.*` without
a seed), PyTorch's CPU generator where the script imported torch (a
`DataLoader` that shuffles draws its order from it), and given a model, its non-trainable variables (its
layers' seed states: measuring a random layer's cost draws from them).
Keras's own compile and fit are not wrapped: they draw what they draw on
plain Keras too.

The same blocks keep Keras's name counters (`keras.src.utils.naming`,
what an unnamed layer, model, optimizer or variable is numbered from):
the package's work builds Keras objects (a traced functional model's
inputs, the calibration's one-layer model, probes), and each took a
number, so the script's next model was `functional_2` where plain Keras
names it `functional_1`, its layers `dense_2` and `input_layer_2`: other
names in its summary, and a `model.get_layer("dense_1")` that fails.
"""

import collections
import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.random import seed_generator
from tensorflow.python.eager import context
from tensorflow.python.ops import stateful_random_ops


@contextlib.contextmanager
def kept(model: Any = None) -> Iterator[None]:
    """Runs the block, then restores every random stream a script draws
    from to where it was before, and `model`'s non-trainable state.

    Why the model's state: measuring an op's cost runs its layer, and a
    random preprocessing layer (RandomFlip, RandomRotation: `training`
    defaults to True) draws from its own `SeedGenerator` as it runs, so
    on a first run (costs not cached yet) training started from other
    seeds than plain Keras's. Non-trainable variables hold those seeds,
    and whatever else a layer's call may update (moving statistics).
    """
    saved = _save()
    states = [(v, v.numpy()) for v in getattr(
        model, "non_trainable_variables", ())]
    try:
        with _writes_undone():
            yield
    finally:
        _restore(saved)
        for variable, value in states:
            _put_back(variable, value)


_COPYING = [0]
_PUTTING_BACK = [0]


def _put_back(variable: Any, value: Any) -> None:
    """`variable` back to `value`, a write no enclosing `kept()` block
    counts as its own (it would put the value from before back).

    Why: planning runs inside two blocks (fit's, then the model's). A
    layer measured at a new batch size reruns the step function traced
    for the first, writing its seeds without a Python `assign` the inner
    block could see; the inner block put the seeds back from its copy of
    the model's state, and the outer block, taking that for a write of
    its own, put the advanced seeds back again (an LSTM with dropout
    trained at batch 16, then 32: its masks drew 96 seeds past plain
    Keras's)."""
    if np.array_equal(variable.numpy(), value):
        return
    _PUTTING_BACK[0] += 1
    try:
        variable.assign(value)
    finally:
        _PUTTING_BACK[0] -= 1


@contextlib.contextmanager
def copying_in() -> Iterator[None]:
    """Writes of Keras variables that bring in the values a strategy's
    executor trained or advanced (its copy out): a `kept()` block around
    them puts those values back, not the stale ones they replaced.

    Why: an executor copies its values out at the first read of a Keras
    variable after its steps; inside a `kept()` block (planning for a new
    batch size) the copy counted as the block's write, and the block put
    the value from before the copy back. A fit with a new batch size
    after a predict then started from the seed states the predict had
    advanced past (a GRU's dropout masks other than plain Keras's)."""
    _COPYING[0] += 1
    try:
        yield
    finally:
        _COPYING[0] -= 1


@contextlib.contextmanager
def _writes_undone() -> Iterator[None]:
    """Runs the block, then puts back every Keras variable it assigned
    (eagerly, or in a function it traced) to its value before.

    Why: a model does not track every variable its layers write. A
    stateful RNN keeps its carried state in variables made outside
    Keras's tracking (`RNN.states`), and its call writes them whatever
    `training` is; measuring the layer's cost on a new machine left the
    state of the measurement's batch there, and training started from
    it rather than from zeros (a stateful LSTM's first loss 0.997212
    against plain Keras's 0.995074). A custom layer may do the same with
    a variable of its own.
    """
    before: dict[int, tuple[Any, Any]] = {}
    assign = KerasVariable.assign

    def noted(variable: Any, value: Any) -> Any:
        if _PUTTING_BACK[0]:
            return assign(variable, value)
        if _COPYING[0]:
            # The runtime's values brought in: what is put back.
            result = assign(variable, value)
            before[id(variable)] = (variable, np.array(variable.numpy()))
            return result
        if id(variable) not in before:
            try:
                with tf.init_scope():  # a trace's write: read eagerly
                    value_before = np.array(variable.numpy())
            except Exception:  # noqa: BLE001 - not initialized yet
                value_before = None
            # One made in a trace reads as an empty array (an int4
            # Embedding's `g_idx`, made and assigned as a clone of it
            # was measured): nothing to put back.
            if (value_before is not None
                    and value_before.shape == tuple(variable.shape)):
                before[id(variable)] = (variable, value_before)
        return assign(variable, value)

    KerasVariable.assign = noted
    try:
        yield
    finally:
        KerasVariable.assign = assign
        for variable, value in before.values():
            _put_back(variable, value)


def _keras_generator() -> Any:
    """Keras's global `SeedGenerator` (what `keras.random.*` without a
    seed draws from), or None before the first such draw made it."""
    return global_state.get_global_attribute(
        seed_generator.GLOBAL_SEED_GENERATOR
    )


def global_seed_state() -> Any:
    """The state variable of Keras's global `SeedGenerator`, or None
    (`_keras_generator`)."""
    generator = _keras_generator()
    return None if generator is None else generator.state


def _save() -> dict[str, Any]:
    eager = context.context()
    op_seeds = getattr(eager, "_rng", None)
    keras_generator = _keras_generator()
    tf_generator = stateful_random_ops.global_generator
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "op_seeds": (op_seeds, op_seeds.getstate() if op_seeds else None),
        "keras": (keras_generator,
                  None if keras_generator is None
                  else keras_generator.state.numpy()),
        "tf_generator": (tf_generator,
                         None if tf_generator is None
                         else tf_generator.state.numpy()),
        "torch": _torch_state(),
        "names": dict(_name_counters()),
    }


@contextlib.contextmanager
def names_kept() -> Iterator[None]:
    """Runs the block, then puts Keras's name counters back: for the
    package's own Keras objects made outside a `kept()` block (the
    symbolic inputs a subclassed model is built on as fit builds it)."""
    saved = dict(_name_counters())
    try:
        yield
    finally:
        _put_names_back(saved)


def _put_names_back(saved: dict[str, int]) -> None:
    counters = _name_counters()
    counters.clear()
    counters.update(saved)


def _name_counters() -> Any:
    """Keras's counters of auto-named objects, prefix -> last number."""
    return global_state.get_global_attribute(
        "object_name_uids", default=collections.defaultdict(int),
        set_to_default=True)


def _torch_state() -> Any:
    """PyTorch's CPU generator state, where the script imported torch
    (never imported here); else None."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.random.get_rng_state()


def _restore(saved: dict[str, Any]) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    op_seeds, state = saved["op_seeds"]
    eager = context.context()
    if op_seeds is not None and getattr(eager, "_rng", None) is op_seeds \
            and op_seeds.getstate() != state:
        op_seeds.setstate(state)
        # An eager random op keeps its kernel, whose stream advanced as
        # it drew, per (global, op) seed pair: the user's next draws get
        # the pairs the package's took, so those kernels must start
        # afresh (as `tf.random.set_seed` makes them).
        eager.clear_kernel_cache()
    keras_generator, state = saved["keras"]
    global_state.set_global_attribute(
        seed_generator.GLOBAL_SEED_GENERATOR, keras_generator
    )
    if keras_generator is not None:
        _put_back(keras_generator.state, state)
    tf_generator, state = saved["tf_generator"]
    if tf_generator is None:
        stateful_random_ops.global_generator = None
    elif stateful_random_ops.global_generator is tf_generator:
        tf_generator.state.assign(state)
    if saved["torch"] is not None:
        sys.modules["torch"].random.set_rng_state(saved["torch"])
    _put_names_back(saved["names"])
