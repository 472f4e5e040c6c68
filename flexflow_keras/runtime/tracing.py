"""The runtime's compiled functions: traced once each, on purpose.

The runtime makes one `tf.function` per (step kind, segment, batch size)
and traces each exactly once (tests count it). TensorFlow's frequent-
retracing warning counts traces by the Python code a function was made
from, so several such functions from one `def` read to it as one function
retracing, and it warns the user ("triggered tf.function retracing") of
a cost that is not paid. Functions made here tell TensorFlow so.
"""

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def step_function(python_function: Callable[..., Any]) -> Any:
    """`tf.function(python_function, autograph=False)`, one trace per
    input signature, without TensorFlow's retracing warning (see the
    module docstring)."""
    function = tf.function(python_function, autograph=False)
    # TF 2.21 reads this private flag before warning; absent in another
    # version, setting it does nothing.
    function._omit_frequent_tracing_warning = True
    return function
