"""The devices strategies run on, set up before TensorFlow initialises them.

Virtual CPU devices must be declared before TensorFlow touches its
devices (i.e. before any model is built), so this runs at package import.
With GPUs present, the GPUs are the devices; otherwise
`--cpu-devices N` / `FLEXFLOW_KERAS_CPU_DEVICES` virtual CPUs (default 4).

In DTensor's multi-client mode (`DTENSOR_JOBS` lists several clients:
`python -m flexflow_keras.launch`, or a cluster scheduler; see
docs/MULTIHOST.md) DTensor is initialised here too, before anything
else touches the devices, and a strategy's device ids are global:
host-major, client k's devices after client k-1's.
"""

import faulthandler
import warnings
from typing import Any

from flexflow_keras import settings as settings_lib

DEFAULT_CPU_DEVICES = 4


def setup_devices(cpu_devices: int | None) -> None:
    """Splits the host CPU into `cpu_devices` logical devices if no GPU.

    Args:
        cpu_devices: Requested count; None means 4 without GPUs, and the
            GPUs (no virtual CPUs) with them.
    """
    import tensorflow as tf

    clients = settings_lib.dtensor_clients()
    if cpu_devices is None and tf.config.list_physical_devices("GPU"):
        if clients is not None:
            _initialize_clients("GPU")
        return
    count = cpu_devices or DEFAULT_CPU_DEVICES
    cpu = tf.config.list_physical_devices("CPU")[0]
    config = [tf.config.LogicalDeviceConfiguration()] * count
    try:
        tf.config.set_logical_device_configuration(cpu, config)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != count:
            warnings.warn(
                f"TensorFlow initialised its devices before flexflow_keras "
                f"was imported, so {count} virtual CPU devices could not be "
                f"made; using {have}. Import flexflow_keras before building "
                "any TensorFlow or Keras object.",
                stacklevel=3,
            )
    if clients is not None:
        _initialize_clients("CPU")


def synchronous_dtensor() -> None:
    """Makes DTensor's device synchronous (each call returns when its
    work is done), before DTensor's first use in this process; a device
    that exists already (the script used DTensor itself first) is left
    as it is.

    Why: in DTensor's default asynchronous mode a step that fails while
    it runs (a label outside the classes, an embedding id past the table,
    an assertion in the user's code) cancels every later DTensor op for
    the life of the process (measured on TF 2.21: each raises
    `CancelledError`; DTensor's own recovery, a copy off the device,
    crashed the process). A script could then neither train the model
    again once its data was mended nor read back what it had trained.
    Synchronous, the failed step raises its error and the next one runs.
    The cost, measured, is in docs/RUNTIME.md ("Synchronous DTensor
    calls"). Not at import: making the device initialises TensorFlow,
    after which a script's own device settings (`set_memory_growth`)
    would fail.
    """
    from tensorflow.dtensor.python import api

    if not dtensor_device_made():
        api.reset_dtensor_device(is_async=False)


def dtensor_device_made() -> bool:
    """Whether this process made DTensor's device already: the settings
    it reads when made (synchronous calls, all-reduce combining) can no
    longer change."""
    from tensorflow.dtensor.python import api

    # TensorFlow's module-level device; if a version renames it, the
    # device is taken to exist (TensorFlow's defaults then stay).
    return getattr(api, "_dtensor_singleton", True) is not None


# Seed every client's random generators alike, before the script runs.
CLIENT_SEED = 0


def _initialize_clients(kind: str) -> None:
    """Joins the DTensor clients (blocks until every client is up) and
    seeds Python's, NumPy's, TensorFlow's and Keras's generators with
    `CLIENT_SEED` on every client.

    Why the seed: every client runs the same script, and each must draw
    the same initial weights and the same shuffle of the data (each
    feeds its own part of every global batch: with different shuffles
    some samples would be read twice and others never). A script that
    sets its own seed sets it on every client alike.
    """
    import keras
    from tensorflow.experimental import dtensor

    _join_all_clients(dtensor, kind, settings_lib.join_timeout_s())
    keras.utils.set_random_seed(CLIENT_SEED)


def _join_all_clients(dtensor: Any, kind: str, timeout_s: float) -> None:
    """`dtensor.initialize_accelerator_system`, bounded in time.

    DTensor's own registration timeout does not bound client 0's wait
    (measured): a host that never comes up would leave the others
    waiting for ever. The wait blocks in C++ holding the GIL, so no
    Python thread can time it; `faulthandler`'s watchdog is a C thread:
    after `timeout_s` it prints "Timeout", the stack (ending in this
    function's name) and exits with status 1.
    """
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        dtensor.initialize_accelerator_system(kind)
    finally:
        faulthandler.cancel_dump_traceback_later()


def client_id() -> int:
    """This process's DTensor client (0 when it runs alone)."""
    clients = settings_lib.dtensor_clients()
    return 0 if clients is None else clients.client_id


def device_names() -> tuple[str, ...]:
    """Full names of the devices a strategy's ids 0..n-1 refer to."""
    import tensorflow as tf

    clients = settings_lib.dtensor_clients()
    if clients is not None:
        from tensorflow.experimental import dtensor

        kind = device_kind()
        local = dtensor.num_local_devices(kind)
        return tuple(
            f"/job:{clients.job_name}/replica:0/task:{k}/device:{kind}:{i}"
            for k in range(clients.num_clients) for i in range(local)
        )
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return tuple(d.name for d in devices)


def local_device_names() -> tuple[str, ...] | None:
    """The devices of `device_names()` this process drives; None when it
    drives all of them (no multi-client mode)."""
    clients = settings_lib.dtensor_clients()
    if clients is None:
        return None
    task = f"/task:{clients.client_id}/"
    return tuple(n for n in device_names() if task in n)


def device_kind() -> str:
    """`GPU` or `CPU`: the kind of the strategy devices."""
    import tensorflow as tf

    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
