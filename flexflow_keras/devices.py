"""The devices strategies run on, set up before TensorFlow initialises them.

Virtual CPU devices must be declared before TensorFlow touches its
devices (i.e. before any model is built), so this runs at package import.
With GPUs present, the GPUs are the devices; otherwise
`--cpu-devices N` / `FLEXFLOW_KERAS_CPU_DEVICES` virtual CPUs (default 4).
"""

import warnings

DEFAULT_CPU_DEVICES = 4


def setup_devices(cpu_devices: int | None) -> None:
    """Splits the host CPU into `cpu_devices` logical devices if no GPU.

    Args:
        cpu_devices: Requested count; None means 4 without GPUs, and the
            GPUs (no virtual CPUs) with them.
    """
    import tensorflow as tf

    if cpu_devices is None and tf.config.list_physical_devices("GPU"):
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


def device_names() -> tuple[str, ...]:
    """Full names of the devices a strategy's ids 0..n-1 refer to."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return tuple(d.name for d in devices)


def device_kind() -> str:
    """`GPU` or `CPU`: the kind of the strategy devices."""
    import tensorflow as tf

    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
