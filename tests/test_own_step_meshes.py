"""The model's own step under strategies on N-D meshes (issue 22).

A model that runs its own step is searched on one mesh whose shape the
search chooses (`mesh_space`, `search.search_meshes`). On virtual CPU
devices, which share the host's cores, the simulator rightly prefers the
1-D mesh, so these tests draw the strategy instead: random configs on a
2-D (or 3-D) mesh, at least one op using two axes, then train the
feature matrix of `test_own_step` and the layer matrix of
`test_layer_support` under it and compare with plain Keras (losses and
weights within 1e-5 relative). Models that run Keras's default step get
a drawn strategy too (their whole space holds every mesh strategy), and
any mesh strategy runs in the model's own step.

The default run uses a 2 x 2 mesh of the 4 test devices; `-m slow` runs
every feature and layer there and, in a process of 8 devices, the fast
ones on 2 x 4 and 2 x 2 x 2 meshes.
"""

import contextlib
import os
import random
import subprocess
import sys
import unittest
from unittest import mock

import pytest

from flexflow_keras import mesh_space, search
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.runtime import model_step
from flexflow_keras.strategy import Strategy
from test_layer_support import FAST as LAYER_FAST
from test_layer_support import FEATURES as LAYERS
from test_own_step import FAST, FEATURES, train_both

HERE = os.path.dirname(os.path.abspath(__file__))
# Built with `search_budget=0` (data parallelism on purpose: see its
# builder in test_own_step), so no strategy is drawn for it.
NOT_SEARCHED = {"distiller_conv_teacher"}


def drawn_strategy(graph, mesh: MeshSpec, rng: random.Random) -> Strategy:
    """Random configs on `mesh`, splitting where an op can; the op with
    the most split choices takes one on two axes when it has one."""
    configs = {}
    for op in graph:
        choices = mesh_space.mesh_configs(op, mesh)
        split = [c for c in choices if c.num_parts > 1] or choices
        configs[op.name] = rng.choice(split)
    wide = [
        (op, [c for c in mesh_space.mesh_configs(op, mesh)
              if sum(g > 1 for g in c.dims) >= 2])
        for op in graph
    ]
    wide = [(op, c) for op, c in wide if c]
    if wide:
        op, choices = rng.choice(wide)
        configs[op.name] = rng.choice(choices)
    strategy, _ = search.tie_shared(graph, Strategy(configs))
    return strategy


@contextlib.contextmanager
def drawing_search(shape: tuple[int, ...], seed: int):
    """Stand-ins for `search.search_meshes` (models that run their own
    step) and `search.search` (Keras's default step, whose whole space
    holds every mesh strategy too) that return a strategy drawn on the
    mesh of `shape` (priced by the simulator they are given)."""

    def drawn(graph, simulator, num_devices, *_, **__):
        strategy = drawn_strategy(graph, MeshSpec.first(shape),
                                  random.Random(seed))
        ms = simulator.simulate(strategy).step_ms
        return search.SearchResult(strategy, ms, ms, iterations=0)

    with mock.patch.object(search, "search_meshes", drawn), \
            mock.patch.object(search, "search", drawn):
        yield


def check_on_mesh(test, shape, names, seed=0, features=FEATURES):
    """Trains each feature of `names` (keys of `features`) under a
    strategy drawn on the mesh of `shape` against plain Keras
    (`train_both`), and checks that the strategy used that mesh."""
    for name in [n for n in names if n not in NOT_SEARCHED]:
        with test.subTest(feature=name, mesh=shape):
            with drawing_search(shape, seed):
                ours = train_both(test, name, features[name])
            mesh = MeshSpec.of(ours.strategy, math_prod(shape))
            test.assertIsNotNone(mesh, ours.strategy)
            test.assertGreaterEqual(len(mesh.shape), 2, ours.strategy)
            # Any mesh strategy runs in the model's own step, Keras's
            # default one too.
            test.assertIsInstance(ours.strategy_executor,
                                  model_step.ModelStepExecutor)


def math_prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


class OwnStepOnMeshesTest(unittest.TestCase):
    def test_features_on_a_2x2_mesh(self):
        check_on_mesh(self, (2, 2), FAST)

    def test_layers_on_a_2x2_mesh(self):
        """The layer matrix (`test_layer_support`): subclassed models and
        layers DTensor has no rule for."""
        check_on_mesh(self, (2, 2), LAYER_FAST, features=LAYERS)


@pytest.mark.slow
class OwnStepOnMeshesMatrixTest(unittest.TestCase):
    def test_every_feature_on_a_2x2_mesh(self):
        check_on_mesh(self, (2, 2), FEATURES, seed=1)

    def test_every_layer_on_a_2x2_mesh(self):
        check_on_mesh(self, (2, 2), LAYERS, seed=1, features=LAYERS)

    def test_8_devices(self):
        """The matrix on 2 x 4 and 2 x 2 x 2 meshes of 8 devices, in a
        process of its own (the device count is fixed at import)."""
        env = dict(os.environ, FLEXFLOW_KERAS_CPU_DEVICES="8",
                   FLEXFLOW_KERAS_MESH_TEST_8="1")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             os.path.join(HERE, "test_own_step_meshes.py"),
             "-k", "EightDevices", "-m", "slow"],
            env=env, capture_output=True, text=True, timeout=3000,
        )
        self.assertEqual(result.returncode, 0,
                         result.stdout[-4000:] + result.stderr[-2000:])


@pytest.mark.slow
@unittest.skipUnless(os.environ.get("FLEXFLOW_KERAS_MESH_TEST_8"),
                     "runs in the 8-device process of test_8_devices")
class EightDevicesTest(unittest.TestCase):
    def test_2x4(self):
        check_on_mesh(self, (2, 4), FAST, seed=2)

    def test_2x2x2(self):
        check_on_mesh(self, (2, 2, 2), FAST, seed=3)

    def test_layers_2x4(self):
        check_on_mesh(self, (2, 4), LAYER_FAST, seed=4, features=LAYERS)
