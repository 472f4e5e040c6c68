"""The runtime's compiled functions: traced once each, on purpose, and
called without Grappler's AddN scheduling.

Traced once: the runtime makes one `tf.function` per (step kind,
segment, batch size) and traces each exactly once (tests count it).
TensorFlow's frequent-retracing warning counts traces by the Python code
a function was made from, so several such functions from one `def` read
to it as one function retracing, and it warns the user ("triggered
tf.function retracing") of a cost that is not paid. Functions made here
tell TensorFlow so.

No AddN scheduling: Grappler's memory optimizer rewrites an AddN of more
than two inputs into a `TemporaryVariable` it adds to in place
(`SchedulingPass`, when its static estimate of a device's peak memory is
over 80% of the device's size: a CPU device counts 256 MiB). Inside a
loop such a variable is named by frame and iteration only, and DTensor's
devices of one process run the same loop body at once: the second
device's variable of the same name fails the step ("AlreadyExistsError:
Resource __per_step_0/.../AddOpsRewrite_AddN/tmp_var/frame:.../iter:200",
measured: keras.io's IMDB Bidirectional LSTM under data parallelism over
2 virtual CPUs, at its first step). Functions made here run with the
memory optimizer off (`RewriterConfig.NO_MEM_OPT`), for their calls only:
the option travels with each call, and a user's own functions keep
TensorFlow's defaults.
"""

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context


def step_function(python_function: Callable[..., Any]) -> Any:
    """`tf.function(python_function, autograph=False)`, one trace per
    input signature, without TensorFlow's retracing warning, called
    without Grappler's AddN scheduling (see the module docstring)."""
    function = tf.function(python_function, autograph=False)
    # TF 2.21 reads this private flag before warning; absent in another
    # version, setting it does nothing.
    function._omit_frequent_tracing_warning = True
    return _WithoutMemoryRewrites(function)


class _WithoutMemoryRewrites:
    """A `tf.function` whose calls run with Grappler's memory optimizer
    off; everything else (tracing, `get_concrete_function`, counts) is
    the function's own."""

    def __init__(self, function: Any):
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with without_memory_rewrites():
            return self.function(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.function, name)


@contextlib.contextmanager
def without_memory_rewrites() -> Iterator[None]:
    """Functions called in this thread, within, run with Grappler's
    memory optimizer off; the thread's options as they were after.

    The same pattern as TensorFlow's `context.function_executor_type`:
    the options are read at each call, so this binds calls, not traces.
    """
    ctx = context.context()
    current = ctx.function_call_options
    previous = copy.copy(current)
    current.config_proto_serialized = _no_memory_optimizer(
        current.config_proto_serialized)
    try:
        yield
    finally:
        ctx.function_call_options = previous


_NO_MEM_OPT: dict = {}  # serialized config -> the same, memory optimizer off


def _no_memory_optimizer(serialized: bytes) -> Any:
    """A serialized `ConfigProto`, as a `ConfigProto` with the memory
    optimizer off."""
    if serialized not in _NO_MEM_OPT:
        config = config_pb2.ConfigProto()
        config.ParseFromString(serialized)
        config.graph_options.rewrite_options.memory_optimization = (
            rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
        _NO_MEM_OPT[serialized] = config
    return _NO_MEM_OPT[serialized]
