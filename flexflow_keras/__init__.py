"""Keras 3 whose `compile()` searches a per-operator parallel strategy.

Change `import keras` to `import flexflow_keras as keras` (or import
`layers`, `Model`, ... from here): every public Keras name means what it
means in Keras; `Model` and `Sequential` add the FlexFlow search at
`compile()` and run `fit()` under the chosen strategy on DTensor.
"""

from flexflow_keras import settings as _settings

# Before TensorFlow loads: no C++ INFO lines unless the user asks.
_settings.quiet_native_logs()
# Before DTensor's first relayout: none by its wrong all-to-all.
_settings.all_gather_relayouts()

from flexflow_keras import devices as _devices  # noqa: E402

# Devices must exist before TensorFlow initialises, i.e. at import.
_devices.setup_devices(_settings.resolve().cpu_devices)

from flexflow_keras import _namespace  # noqa: E402
from flexflow_keras import own_loops as _own_loops  # noqa: E402

# A user's tf.function calls our models as Keras's: not converted.
_own_loops.keep_package_unconverted()

from flexflow_keras import models  # noqa: E402
from flexflow_keras.models import Model, Sequential  # noqa: E402
from flexflow_keras.strategy import ParallelConfig, Strategy  # noqa: E402

_namespace.mirror(
    globals(), __name__,
    own={"Model", "Sequential", "models", "applications", "saving",
         "layers", "utils"},
)
# Model builders and loaders return our models (weights and layers kept).
_namespace.mirror_with(
    globals(), __name__, "applications",
    lambda name, value: _namespace.returning(models.as_flexflow_model)(value)
    if callable(value) and name[:1].isupper() else value,
)
# Every public way from a config back to an object: a model's config
# comes back ours (`keras.utils.deserialize_keras_object` is saving's).
_loaders = {
    "load_model": models.load_model,
    "deserialize_keras_object": models.deserialize_keras_object,
}
for _name in ("saving", "utils"):
    _namespace.mirror_with(
        globals(), __name__, _name,
        lambda name, value: _loaders.get(name, value),
    )
del _name, _loaders  # the copies hold the replacements
_namespace.mirror_with(
    globals(), __name__, "layers",
    lambda name, value: models.deserialize_layer
    if name == "deserialize" else value,
)
# A script's `tf.keras.Model` (Keras 3's `tf.keras` is Keras) is ours too.
_namespace.route_tf_keras(globals())

__version__ = "0.1.0"
