"""Small Keras models shared by the benches and the test files
(tests/conftest.py puts this folder on the path).

Each builder returns a plain `keras.Model` (functional API, full
`keras.Input` shapes, plain `keras` layers) so tests can compare our
results with plain Keras. Layers carry fixed names, which tests and
strategy files rely on: keep names and defaults stable.

Defaults are small so a test builds a model in well under a second;
every size is a keyword argument so benches can build the paper-sized
versions (see `dlrm`).
"""

import contextlib

import keras

__all__ = [
    "cnn",
    "dlrm",
    "lstm_model",
    "mlp",
    "nested",
    "shared_layer",
    "transformer_block",
    "two_input_concat",
    "without_weight_values",
]


@contextlib.contextmanager
def without_weight_values():
    """Build models whose variables have path, shape and dtype but no
    value: enough for `build_graph` and the search on full-size models.

    Inside a Keras `StatelessScope(initialize_variables=False)` a new
    variable is deferred and put on Keras's process-wide list of
    uninitialized variables, and the next outermost `StatelessScope` to
    close anywhere in the process initializes the whole list, whatever
    runs there: a later test's probe then allocated the bench's
    20000 x 1024 embedding inside a DTensor function and failed ("Mul got
    a regular tensor ... expecting a DTensor"). So the variables made
    here leave that list on exit: they are never given values (reading
    one gives a fresh initializer draw, as Keras does for a deferred
    variable), and a test that needs values builds without this."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.stateless_scope import StatelessScope

    key = "uninitialized_variables"
    before = list(global_state.get_global_attribute(key, []) or [])
    try:
        with StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute(key, before)


def mlp(
    input_dim: int = 32, hidden: tuple[int, ...] = (64, 64), classes: int = 10
) -> keras.Model:
    """Dense stack: `x` -> `dense_0..` (relu) -> `logits` (no activation).

    Args:
        input_dim: Features per sample.
        hidden: Units of each hidden `Dense`.
        classes: Units of the output `Dense` named `logits`.
    """
    x = inputs = keras.Input(shape=(input_dim,), name="x")
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


def cnn(
    input_shape: tuple[int, int, int] = (16, 16, 3),
    filters: tuple[int, ...] = (8, 16),
    classes: int = 10,
    dropout_rate: float = 0.5,
) -> keras.Model:
    """Conv net: per block `conv_i` (3x3 same, relu) -> `bn_i` -> `pool_i`.

    Then `flatten` -> `dropout` -> `logits`. Use `dropout_rate=0.0` where a
    test compares training trajectories with plain Keras (no randomness).

    Args:
        input_shape: (height, width, channels), channels last.
        filters: Filters of each conv block; each block halves H and W.
        classes: Units of the output `Dense`.
        dropout_rate: Rate of the `Dropout` before the output.
    """
    x = inputs = keras.Input(shape=input_shape, name="image")
    for i, f in enumerate(filters):
        x = keras.layers.Conv2D(
            f, 3, padding="same", activation="relu", name=f"conv_{i}"
        )(x)
        x = keras.layers.BatchNormalization(name=f"bn_{i}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dropout(dropout_rate, name="dropout")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")


def two_input_concat(
    a_dim: int = 8, b_dim: int = 12, units: int = 16
) -> keras.Model:
    """Inputs `a`, `b` -> `dense_a`, `dense_b` -> `concat` -> `out` (1 unit).

    Args:
        a_dim: Features of input `a`.
        b_dim: Features of input `b`.
        units: Units of `dense_a` and `dense_b`.
    """
    a = keras.Input(shape=(a_dim,), name="a")
    b = keras.Input(shape=(b_dim,), name="b")
    ha = keras.layers.Dense(units, activation="relu", name="dense_a")(a)
    hb = keras.layers.Dense(units, activation="relu", name="dense_b")(b)
    x = keras.layers.Concatenate(name="concat")([ha, hb])
    outputs = keras.layers.Dense(1, name="out")(x)
    return keras.Model([a, b], outputs, name="two_input_concat")


def nested(
    kind: str = "sequential", input_dim: int = 8, units: int = 16
) -> keras.Model:
    """Functional model with a submodel `inner` holding Dense `a` and `b`.

    `x` -> `pre` -> `inner` (`a` relu -> `b`) -> `head` (1 unit); the
    graph names the inner ops `inner/a` and `inner/b`.

    Args:
        kind: `"sequential"` or `"functional"`: how `inner` is built.
        input_dim: Features per sample.
        units: Units of `pre`, `a` and `b`.
    """
    if kind == "sequential":
        inner = keras.Sequential(
            [
                keras.Input(shape=(units,)),
                keras.layers.Dense(units, activation="relu", name="a"),
                keras.layers.Dense(units, name="b"),
            ],
            name="inner",
        )
    elif kind == "functional":
        y = inner_in = keras.Input(shape=(units,))
        y = keras.layers.Dense(units, activation="relu", name="a")(y)
        y = keras.layers.Dense(units, name="b")(y)
        inner = keras.Model(inner_in, y, name="inner")
    else:
        raise ValueError(
            "`kind` must be 'sequential' or 'functional'. "
            f"Received: kind={kind!r}"
        )
    inputs = keras.Input(shape=(input_dim,), name="x")
    x = keras.layers.Dense(units, name="pre")(inputs)
    x = inner(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    return keras.Model(inputs, outputs, name="nested")


def shared_layer(input_dim: int = 8, units: int = 16) -> keras.Model:
    """One Dense `shared` called on inputs `x1` then `x2`, then `add`, `head`.

    The graph has ops `shared` and `shared#1` (same weights).

    Args:
        input_dim: Features of each input.
        units: Units of `shared`.
    """
    x1 = keras.Input(shape=(input_dim,), name="x1")
    x2 = keras.Input(shape=(input_dim,), name="x2")
    shared = keras.layers.Dense(units, activation="relu", name="shared")
    x = keras.layers.Add(name="add")([shared(x1), shared(x2)])
    outputs = keras.layers.Dense(1, name="head")(x)
    return keras.Model([x1, x2], outputs, name="shared_layer")


def transformer_block(
    seq: int = 16, dim: int = 32, heads: int = 4, ff: int | None = None
) -> keras.Model:
    """Post-norm Transformer encoder block over `tokens` (seq, dim).

    `attention` (self-attention) -> `add_1` -> `norm_1` -> `ff_1` (relu)
    -> `ff_2` -> `add_2` -> `norm_2`.

    Args:
        seq: Sequence length.
        dim: Model width; `key_dim = dim // heads`.
        heads: Attention heads.
        ff: Feed-forward width; default `2 * dim`.
    """
    ff = ff or 2 * dim
    inputs = keras.Input(shape=(seq, dim), name="tokens")
    attended = keras.layers.MultiHeadAttention(
        heads, dim // heads, name="attention"
    )(inputs, inputs)
    x = keras.layers.Add(name="add_1")([inputs, attended])
    x = keras.layers.LayerNormalization(name="norm_1")(x)
    h = keras.layers.Dense(ff, activation="relu", name="ff_1")(x)
    h = keras.layers.Dense(dim, name="ff_2")(h)
    x = keras.layers.Add(name="add_2")([x, h])
    outputs = keras.layers.LayerNormalization(name="norm_2")(x)
    return keras.Model(inputs, outputs, name="transformer_block")


def lstm_model(
    seq: int = 10, features: int = 8, units: int = 16, classes: int = 4
) -> keras.Model:
    """`sequence` -> `lstm_1` (sequences) -> `lstm_2` (last) -> `logits`.

    Args:
        seq: Time steps.
        features: Features per step.
        units: Units of both LSTMs.
        classes: Units of the output `Dense`.
    """
    inputs = keras.Input(shape=(seq, features), name="sequence")
    x = keras.layers.LSTM(units, return_sequences=True, name="lstm_1")(inputs)
    x = keras.layers.LSTM(units, name="lstm_2")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="lstm_model")


def dlrm(
    num_tables: int = 8,
    rows: int = 100,
    dim: int = 8,
    dense_features: int = 8,
    bottom: tuple[int, ...] = (16, 8),
    top: tuple[int, ...] = (32, 1),
    defer_weights: bool = False,
) -> keras.Model:
    """DLRM-style recommender, as in the FlexFlow paper's case study.

    Inputs `dense` (dense_features floats) and `sparse_i` (one int32 id
    each). Bottom MLP `bottom_j` (relu) on `dense`; per table `embedding_i`
    (rows x dim) -> `flatten_i`; `concat` of all; top MLP `top_j` (relu,
    the last one linear). The case-study model is
    `dlrm(8, 1_000_000, 64, 64, (512, 512, 64), (1024, 1024, 1024, 1),
    defer_weights=True)` (concat width 64 + 8 * 64 = 576).

    Keras creates every variable when a layer is first called, so a model
    built normally allocates its tables (8 x 1e6 x 64 float32 = 2 GB).
    With `defer_weights=True` the model is built in
    `without_weight_values()`: variables have their path, shape and
    dtype but no value, enough for `build_graph` and the search; do not
    pass it where a test needs the values.

    Args:
        num_tables: Embedding tables (one sparse input each).
        rows: Rows per table (vocabulary size).
        dim: Embedding width.
        dense_features: Width of the dense input.
        bottom: Units of the bottom MLP's `Dense` layers.
        top: Units of the top MLP's `Dense` layers; the last is the output.
        defer_weights: Build without allocating variable values.
    """
    scope = contextlib.nullcontext()
    if defer_weights:
        scope = without_weight_values()
    with scope:
        dense = keras.Input(shape=(dense_features,), name="dense")
        x = dense
        for j, units in enumerate(bottom):
            x = keras.layers.Dense(
                units, activation="relu", name=f"bottom_{j}"
            )(x)
        features = [x]
        sparse = []
        for i in range(num_tables):
            ids = keras.Input(shape=(1,), dtype="int32", name=f"sparse_{i}")
            sparse.append(ids)
            e = keras.layers.Embedding(rows, dim, name=f"embedding_{i}")(ids)
            features.append(keras.layers.Flatten(name=f"flatten_{i}")(e))
        x = keras.layers.Concatenate(name="concat")(features)
        for j, units in enumerate(top):
            activation = "relu" if j < len(top) - 1 else None
            x = keras.layers.Dense(
                units, activation=activation, name=f"top_{j}"
            )(x)
        return keras.Model([dense, *sparse], x, name="dlrm")


def load_script(path: str):
    """The module of the project file `path` (relative to the project
    root, e.g. `bench/search_bench.py`), imported without running its
    `__main__` block."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = os.path.splitext(path)[0].replace("/", "_")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, path)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name: str):
    """The module of `examples/<name>.py` (its `build_model(small)`,
    `make_data`, `SMALL` and `FULL`)."""
    return load_script(f"examples/{name}.py")
