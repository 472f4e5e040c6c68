"""The input pipelines Keras builds for a fit run without tf.data's
autotuning thread, which stalled every epoch start.

Keras drops each epoch's `tf.data` iterator when the next epoch starts
(and validation's at each evaluation). Destroying an iterator waits for
its autotuning thread (`RootDataset::Iterator::~Iterator` ->
`Model::OptimizeLoop`), and on TensorFlow 2.21 that thread is not woken:
it finishes its current sleep, which doubles after each optimization up
to 60 s, so the wait grows with the epoch it follows. Found with gdb on
all threads during a stall (main thread in `~Iterator`, the model
thread in `OptimizeLoop`'s timed wait). Measured on 4 virtual CPUs
(Inception-v3 `--small`, 4 epochs of 2 steps, `bench/epoch_start_bench.py`):
the second epoch's start waited 13-38 s in 5 of 6 runs (its first epoch,
with tracing and SPMD expansion, is long); plain Keras, whose epochs
there take about a second, waited 0.4-0.6 s, and 5.1 s after an epoch a
callback made 5 s long. With autotuning off, no run waited over 0.05 s.

So the datasets Keras makes itself from arrays, tensors, generators and
`PyDataset`s (nothing in them to tune but the map's parallelism and the
prefetch depth: the map runs at tf.data's default parallelism and the
prefetch grows its buffer by its own rule) run with autotuning off while
a flexflow_keras model fits, evaluates or predicts. Element order and
values are unchanged. A user's own `tf.data.Dataset` is left as built.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from keras.src.trainers.data_adapters import (
    array_data_adapter, generator_data_adapter, py_dataset_adapter,
)

# The adapters whose `get_tf_dataset` builds a pipeline of Keras's own.
KERAS_BUILT = (
    array_data_adapter.ArrayDataAdapter,
    generator_data_adapter.GeneratorDataAdapter,
    py_dataset_adapter.PyDatasetAdapter,
)

_ACTIVE = [0]  # inside `untuned()`


@contextlib.contextmanager
def untuned() -> Iterator[None]:
    """While inside, Keras-built pipelines have autotuning off."""
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1


def without_autotune(dataset: Any) -> Any:
    """`dataset` with tf.data's autotuning (and its thread) off."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _patched(get_tf_dataset: Any) -> Any:
    def patched(self):
        dataset = get_tf_dataset(self)
        if _ACTIVE[0] and isinstance(dataset, tf.data.Dataset):
            return without_autotune(dataset)
        return dataset

    patched._untuned = True
    return patched


def install() -> None:
    """Patches the Keras-built adapters (once)."""
    for adapter in KERAS_BUILT:
        method = adapter.get_tf_dataset
        if not getattr(method, "_untuned", False):
            adapter.get_tf_dataset = _patched(method)


install()
