"""The model's own step under strategies on N-D meshes (issue 22).

A model that runs its own step is searched on one mesh whose shape the
search chooses (`mesh_space`, `search.search_meshes`). On virtual CPU
devices, which share the host's cores, the simulator rightly prefers the
1-D mesh, so these tests draw the strategy instead: random configs on a
2-D (or 3-D) mesh, at least one op using two axes, then train the
feature matrix of `test_own_step` under it and compare with plain Keras
(losses and weights within 1e-5 relative).

The default run uses a 2 x 2 mesh of the 4 test devices; `-m slow` runs
every feature there and, in a process of 8 devices, on 2 x 4 and
2 x 2 x 2 meshes.
"""

import os
import random
import subprocess
import sys
import unittest
from unittest import mock

import pytest

from flexflow_keras import mesh_space, runtime, search
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.strategy import Strategy
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


def drawing_search(shape: tuple[int, ...], seed: int):
    """A stand-in for `search.search_meshes` that returns a strategy
    drawn on the mesh of `shape` (priced by the simulator it is given)."""

    def search_meshes(graph, simulator, num_devices, budget, meshes=None,
                      seed_=None, **_):
        strategy = drawn_strategy(graph, MeshSpec.first(shape),
                                  random.Random(seed))
        ms = simulator.simulate(strategy).step_ms
        return search.SearchResult(strategy, ms, ms, iterations=0)

    return mock.patch.object(search, "search_meshes", search_meshes)


def check_on_mesh(test, shape, names, seed=0):
    for name in [n for n in names if n not in NOT_SEARCHED]:
        with test.subTest(feature=name, mesh=shape):
            with drawing_search(shape, seed):
                ours = train_both(test, name)
            if not runtime.own_step_reasons(ours):
                continue  # Keras's default step: the whole SOAP space
            mesh = MeshSpec.of(ours.strategy, math_prod(shape))
            test.assertIsNotNone(mesh, ours.strategy)
            test.assertGreaterEqual(len(mesh.shape), 2, ours.strategy)


def math_prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


class OwnStepOnMeshesTest(unittest.TestCase):
    def test_features_on_a_2x2_mesh(self):
        check_on_mesh(self, (2, 2), FAST)


@pytest.mark.slow
class OwnStepOnMeshesMatrixTest(unittest.TestCase):
    def test_every_feature_on_a_2x2_mesh(self):
        check_on_mesh(self, (2, 2), FEATURES, seed=1)

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
