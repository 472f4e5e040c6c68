"""Helpers of the runtime tests: train a model both ways and compare.

Not a test module (it holds no tests): `test_runtime_equivalence.py` and
`test_runtime_keras.py` import it.
"""

import contextlib
import os
import random

import keras
import numpy as np

import model_zoo
from flexflow_keras import runtime
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy import ParallelConfig, Strategy

NUM_DEVICES = 4


class StrategyModel(runtime.StrategyTrainer, keras.Model):
    """What models.py's Model is to the runtime: Keras + the mixin."""


def _int_ids(n, rows, seed):
    return np.random.default_rng(seed).integers(0, rows, (n, 1))


# name -> (builder, data(n) -> (x, y), loss)
def _dense_data(dim, out):
    def data(n, seed=0):
        rng = np.random.default_rng(seed)
        x = rng.random((n, dim), dtype=np.float32)
        y = rng.random((n, out), dtype=np.float32)
        return x, y

    return data


def _cnn_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 8, 8, 3), dtype=np.float32)
    y = rng.integers(0, 4, (n,))
    return x, y


def _two_input_data(dim_a, dim_b):
    def data(n, seed=0):
        rng = np.random.default_rng(seed)
        return (
            [rng.random((n, dim_a), dtype=np.float32),
             rng.random((n, dim_b), dtype=np.float32)],
            rng.random((n, 1), dtype=np.float32),
        )

    return data


def _transformer_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 8, 16), dtype=np.float32)
    return x, rng.random((n, 8, 16), dtype=np.float32)


def _dlrm_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = {"dense": rng.random((n, 4), dtype=np.float32)}
    for i in range(2):
        x[f"sparse_{i}"] = rng.integers(0, 20, (n, 1)).astype("int32")
    return x, rng.random((n, 1), dtype=np.float32)


def _dense_data_seq(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 4, 4), dtype=np.float32)
    return x, rng.random((n, 4), dtype=np.float32)


MODELS = {
    "mlp": (
        lambda: model_zoo.mlp(input_dim=8, hidden=(16, 16), classes=4),
        _dense_data(8, 4), "mse",
    ),
    "cnn": (
        lambda: model_zoo.cnn((8, 8, 3), (4, 8), classes=4, dropout_rate=0.0),
        _cnn_data,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ),
    "two_input_concat": (model_zoo.two_input_concat, _two_input_data(8, 12),
                         "mse"),
    "nested": (model_zoo.nested, _dense_data(8, 1), "mse"),
    "transformer": (
        lambda: model_zoo.transformer_block(seq=8, dim=16, heads=2),
        _transformer_data, "mse",
    ),
    "embedding": (
        lambda: model_zoo.dlrm(2, 20, 4, 4, (8, 4), (8, 1)),
        _dlrm_data, "mse",
    ),
    "shared_layer": (model_zoo.shared_layer, _two_input_data(8, 8), "mse"),
    "lstm": (
        lambda: model_zoo.lstm_model(seq=4, features=4, units=8, classes=4),
        _dense_data_seq, "mse",
    ),
}

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01),
    "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.001),
}


def data_parallel(graph):
    return Strategy.data_parallel(graph, NUM_DEVICES)


def placement(graph):
    """Pure operator placement: op i whole on device i mod n."""
    return Strategy({
        op.name: ParallelConfig((1,) * max(op.rank, 1), (i % NUM_DEVICES,))
        for i, op in enumerate(graph)
    })


def several_meshes(graph) -> Strategy:
    """Operator placement over two meshes: ops alternate between devices
    (0, 1) and (2, 3), splitting the batch where they can (the
    layer-by-layer executor runs it)."""
    configs = {}
    for index, op in enumerate(graph):
        devices = (0, 1) if index % 2 == 0 else (2, 3)
        dims = (1,) * max(op.rank, 1)
        if 0 in op.partitionable:
            dims = (2,) + dims[1:]
        else:
            devices = devices[:1]
        configs[op.name] = ParallelConfig(dims, devices)
    return Strategy(configs)


def parameter(graph):
    """Parameter split over all devices where an op has one, else DP."""
    configs = dict(data_parallel(graph))
    for op in graph:
        dim = op.parameter_dim
        if dim is not None and op.output_shape[dim] % NUM_DEVICES == 0:
            dims = [1] * op.rank
            dims[dim] = NUM_DEVICES
            configs[op.name] = ParallelConfig(
                tuple(dims), tuple(range(NUM_DEVICES))
            )
    return Strategy(configs)


def random_strategy(seed, tied=True):
    """Random configs, a shared layer's calls tied as the search ties
    them (`tied=False`: as drawn)."""
    def make(graph):
        from flexflow_keras.search_space import random_config, tie_shared

        rng = random.Random(seed)
        strategy = Strategy({
            op.name: random_config(op, NUM_DEVICES, rng) for op in graph
        })
        return tie_shared(graph, strategy)[0] if tied else strategy

    return make


def build_pair(name, optimizer="sgd", metrics=None):
    """(plain Keras model, StrategyModel) with equal weights, compiled."""
    builder, _, loss = MODELS[name]
    keras.utils.set_random_seed(0)
    ref = builder()
    keras.utils.set_random_seed(0)
    base = builder()
    model = StrategyModel(
        base._inputs_struct, base._outputs_struct, name=base.name
    )
    model.set_weights(ref.get_weights())
    ref.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss,
                metrics=metrics)
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss,
                  metrics=metrics)
    return ref, model


def attach(model, make_strategy, batch_size):
    graph = build_graph(model, batch_size)
    strategy = make_strategy(graph)
    runtime.attach_strategy(model, graph, strategy)
    return strategy


def relative_error(a, b, atol=1e-6):
    """||a - b|| / ||b||, with `atol` per element as a floor on ||b||.

    Why the floor: a weight whose gradient is zero in exact arithmetic
    (e.g. an attention key bias) moves by rounding noise only.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    floor = atol * np.sqrt(max(b.size, 1)) / 1e-5
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))


def assert_same_training(test, ref, model, history_ref, history, rtol=1e-5):
    for key, values in history_ref.history.items():
        np.testing.assert_allclose(
            history.history[key], values, rtol=rtol, atol=1e-7, err_msg=key
        )
    for w, r, v in zip(model.weights, ref.get_weights(), model.get_weights()):
        test.assertLess(relative_error(v, r), rtol, msg=w.path)


def fit_plain_and_ours(build, make_strategy, batch, seed, compile_args,
                       **fit):
    """`build(module)`'s uncompiled model made with plain Keras and with
    flexflow_keras from `seed`, compiled with `compile_args` (ours with
    `make_strategy(graph)` imported), each fitted with `fit` at `batch`.

    Returns (histories, models, messages): the first two keyed "plain"
    and "ours", the last the messages of the warnings ours raised."""
    import tempfile
    import warnings

    import flexflow_keras as fk
    from flexflow_keras.strategy_files import save_strategy

    histories, models = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(seed)
            model = build(mod)
            options = {}
            if mod is fk:
                options["import_strategy"] = os.path.join(folder, "s.txt")
                save_strategy(make_strategy(build_graph(model, batch)),
                              options["import_strategy"])
            model.compile(**compile_args, **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                histories[name] = model.fit(batch_size=batch, **fit).history
            models[name] = model
    return histories, models, [str(w.message) for w in caught]


def train_plain_and_ours(build, seed, train):
    """`train(model)` on `build(module)`'s model made from `seed`, with
    plain Keras and with flexflow_keras (searched as compile() searches).

    Returns {"plain": (model, result, messages), "ours": ...}: `result`
    is what `train` returned, `messages` the warnings raised meanwhile."""
    import warnings

    import flexflow_keras as fk

    runs = {}
    for name, mod in (("plain", keras), ("ours", fk)):
        keras.utils.set_random_seed(seed)
        model = build(mod)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(model)
        runs[name] = (model, result, [str(w.message) for w in caught])
    return runs


def assert_own_step_under_strategy(test, runs):
    """`train_plain_and_ours`'s flexflow_keras model ran its own step
    under its strategy: no warning of plain Keras, and the executor its
    strategy asks for (`assert_executor_of_its_strategy`)."""
    ours, _, messages = runs["ours"]
    assert_not_handed_over(test, messages, messages)
    assert_executor_of_its_strategy(test, ours)


def assert_not_handed_over(test, messages, where=None):
    """No warning message in `messages` says the model went to plain
    Keras: a step handed over computes what plain Keras computes, and
    passes every comparison with it."""
    test.assertEqual([m for m in messages if "plain Keras" in m], [], where)


def on_one_mesh(model) -> bool:
    """Whether `model`'s strategy runs on one DTensor mesh of the devices
    it was planned for (`search_space.is_one_mesh` over its plan's
    machine). Counted over the devices the strategy uses instead, the
    blocks of a 2x2 mesh that leave device 3 idle read as three devices
    no mesh covers, and a one-mesh plan as several meshes."""
    from flexflow_keras.search_space import is_one_mesh

    machine = model.plan.machine
    return is_one_mesh(model.strategy,
                       machine.num_devices if machine else None)


def assert_executor_of_its_strategy(test, model):
    """`model` trains under the executor its strategy asks for: its own
    step on the strategy's one mesh (`ModelStepExecutor`), or, for a
    model with nothing of its own that a search put on several meshes,
    Keras's default step layer by layer (`step.Executor`). Which of the
    two a search gives depends on the costs the machine measures."""
    from flexflow_keras import runtime
    from flexflow_keras.runtime import model_step, step

    if (isinstance(model.strategy_executor, step.Executor)
            and not on_one_mesh(model)
            and not runtime.own_step_reasons(model)):
        return
    test.assertIsInstance(model.strategy_executor,
                          model_step.ModelStepExecutor)


def assert_same_fits(test, histories, models, rtol=1e-5, atol=1e-6):
    """`histories` (History.history dicts) and `models`, each keyed
    "plain" and "ours": every logged value and weight equal within
    `rtol` (and `atol` absolute: a loss that crosses zero)."""
    for key, values in histories["plain"].items():
        np.testing.assert_allclose(histories["ours"][key], values,
                                   rtol=rtol, atol=atol, err_msg=key)
    for a, b in zip(models["plain"].get_weights(),
                    models["ours"].get_weights()):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def assert_same_runs(test, runs, **tolerances):
    """`assert_same_fits` on `train_plain_and_ours`'s runs whose `train`
    returned a History's dict (`tolerances`: its `rtol`, `atol`)."""
    assert_same_fits(test, {name: run[1] for name, run in runs.items()},
                     {name: run[0] for name, run in runs.items()},
                     **tolerances)


def assert_same_fit_evaluate_predict(test, runs):
    """`train_plain_and_ours`'s runs whose `train` returned `[history
    dict, evaluate(), predict()]`: all three and the weights equal."""
    (_, expected, _), (_, got, _) = runs["plain"], runs["ours"]
    assert_same_runs(test, {name: (run[0], run[1][0])
                            for name, run in runs.items()})
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-5, atol=1e-6)


def fresh_caches(test):
    """Nothing measured for the rest of `test`, as on a new user's
    machine: the op-cost, live-machine and probe caches point at an
    empty folder (measuring runs layers, which is what some tests are
    about: it drew from random layers' seeds and TensorFlow's kernels)."""
    import tempfile
    from unittest import mock

    from flexflow_keras import calibration, cost
    from flexflow_keras.runtime import probe

    folder = tempfile.mkdtemp()
    for module in (cost, calibration, probe):
        patcher = mock.patch.object(
            module, "DEFAULT_CACHE_PATH",
            os.path.join(folder, f"{module.__name__}.json"))
        patcher.start()
        test.addCleanup(patcher.stop)


@contextlib.contextmanager
def float64():
    """Keras's float type and its global dtype policy (which Keras
    caches from the float type when a layer first reads it) in float64,
    both put back after."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
