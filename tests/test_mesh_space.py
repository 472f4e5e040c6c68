"""Strategies on one N-D mesh (`mesh_space`): what a model's own step runs.

The rules checked by hand here: a config is the block of the mesh that
computes one copy of its op; each split dim takes one axis of its size;
files written for the 1-D one-mesh space are mesh strategies unchanged.
"""

import random
import unittest

import numpy as np

from hand_graphs import hand_graph
from flexflow_keras import mesh_space
from flexflow_keras.mesh_space import MeshSpec, axes_on, block_config
from flexflow_keras.strategy import ParallelConfig, Strategy, validate_config


class MeshShapesTest(unittest.TestCase):
    def test_ordered_factorizations_one_axis_first(self):
        self.assertEqual(
            mesh_space.mesh_shapes(8),
            ((8,), (2, 4), (4, 2), (2, 2, 2)),
        )
        self.assertEqual(mesh_space.mesh_shapes(1), ((1,),))
        self.assertEqual(mesh_space.mesh_shapes(7), ((7,),))
        self.assertNotIn((2, 2, 2, 2), mesh_space.mesh_shapes(16))

    def test_bad_device_count_is_refused(self):
        with self.assertRaisesRegex(ValueError, "num_devices"):
            mesh_space.mesh_shapes(0)


class BlockConfigTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = hand_graph(batch=8)  # dense (8, 6): sample, parameter
        cls.dense = cls.graph.op("dense_0")
        cls.wide = hand_graph(batch=8).op("dense_0")
        cls.mesh = MeshSpec.first((2, 2))  # [[0, 1], [2, 3]]

    def test_blocks_by_hand(self):
        # Batch over the outer axis: one column of the grid; the other
        # column computes a copy.
        self.assertEqual(block_config(self.dense, self.mesh, {0: 0}),
                         ParallelConfig((2, 1), (0, 2)))
        # Batch over the inner axis: one row.
        self.assertEqual(block_config(self.dense, self.mesh, {0: 1}),
                         ParallelConfig((2, 1), (0, 1)))
        # Batch outer, channels inner: the whole grid, row-major.
        self.assertEqual(block_config(self.dense, self.mesh, {0: 0, 1: 1}),
                         ParallelConfig((2, 2), (0, 1, 2, 3)))
        # Batch inner, channels outer: the grid transposed.
        self.assertEqual(block_config(self.dense, self.mesh, {0: 1, 1: 0}),
                         ParallelConfig((2, 2), (0, 2, 1, 3)))

    def test_axes_on_inverts_block_config(self):
        for mesh in (MeshSpec.first(s) for s in ((4,), (2, 2))):
            for config in mesh_space.mesh_configs(self.dense, mesh):
                axes = axes_on(config, mesh)
                self.assertIsNotNone(axes, (config, mesh))
                self.assertEqual(block_config(self.dense, mesh, axes),
                                 config)
                validate_config(self.dense, config, 4)

    def test_configs_not_on_the_mesh(self):
        # Devices (0, 3) are no row or column of [[0, 1], [2, 3]].
        self.assertIsNone(axes_on(ParallelConfig((2, 1), (0, 3)), self.mesh))
        # Two split dims need two axes; the 1-D mesh has one.
        self.assertIsNone(
            axes_on(ParallelConfig((2, 2), (0, 1, 2, 3)), MeshSpec.first((4,)))
        )
        # A degree no axis has.
        self.assertIsNone(
            axes_on(ParallelConfig((4, 1), (0, 1, 2, 3)), self.mesh)
        )
        # Unsplit on the first device: replicated, no axis.
        self.assertEqual(axes_on(ParallelConfig((1, 1), (0,)), self.mesh), {})
        # Blocks away from the first device are placements: not copies.
        self.assertIsNone(axes_on(ParallelConfig((1, 1), (3,)), self.mesh))
        self.assertIsNone(axes_on(ParallelConfig((2, 1), (2, 3)), self.mesh))

    def test_mesh_configs_most_devices_first_unsplit_last(self):
        configs = mesh_space.mesh_configs(self.dense, self.mesh)
        # 6 units split 2 ways only: every assignment of the two axes.
        self.assertEqual(configs, [
            ParallelConfig((2, 2), (0, 1, 2, 3)),
            ParallelConfig((2, 2), (0, 2, 1, 3)),
            ParallelConfig((2, 1), (0, 1)),
            ParallelConfig((2, 1), (0, 2)),
            ParallelConfig((1, 2), (0, 1)),
            ParallelConfig((1, 2), (0, 2)),
            ParallelConfig((1, 1), (0,)),
        ])
        relu = self.graph.op("relu")  # sample only
        self.assertEqual(mesh_space.mesh_configs(relu, MeshSpec.first((4,)))[0],
                         ParallelConfig((4, 1), (0, 1, 2, 3)))


class MeshOfStrategyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = hand_graph(batch=8)
        cls.names = [op.name for op in cls.graph]

    def test_one_mesh_files_are_1d_meshes(self):
        same = {n: ParallelConfig((4, 1), (0, 1, 2, 3)) for n in self.names}
        self.assertEqual(MeshSpec.of(same, 4), MeshSpec((4,), (0, 1, 2, 3)))
        two = {n: ParallelConfig((2, 1), (1, 2)) for n in self.names}
        self.assertEqual(MeshSpec.of(two, 4), MeshSpec((2,), (1, 2)))

    def test_hybrid_strategy_is_a_2d_mesh(self):
        grid = {n: ParallelConfig((2, 1), (0, 2)) for n in self.names}
        grid["dense_0"] = ParallelConfig((2, 2), (0, 1, 2, 3))
        self.assertEqual(MeshSpec.of(grid, 4), MeshSpec((2, 2), (0, 1, 2, 3)))

    def test_placements_are_several_meshes(self):
        placed = {"dense_0": ParallelConfig((2, 1), (0, 1)),
                  "dense_1": ParallelConfig((2, 1), (2, 3)),
                  "dense_2": ParallelConfig((2, 1), (0, 1)),
                  "relu": ParallelConfig((2, 1), (0, 1))}
        self.assertIsNone(MeshSpec.of(placed, 4))

    def test_several_meshes_are_none(self):
        moved = {n: ParallelConfig((4, 1), (0, 1, 2, 3)) for n in self.names}
        moved["relu"] = ParallelConfig((4, 1), (1, 0, 2, 3))
        self.assertIsNone(MeshSpec.of(moved, 4))
        mixed = {n: ParallelConfig((4, 1), (0, 1, 2, 3)) for n in self.names}
        mixed["dense_0"] = ParallelConfig((2, 2), (0, 1, 2, 3))
        self.assertIsNone(MeshSpec.of(mixed, 4))

    def test_random_mesh_strategies_are_on_their_mesh(self):
        rng = random.Random(0)
        for shape in mesh_space.mesh_shapes(8):
            mesh = MeshSpec.first(shape)
            for _ in range(20):
                configs = {}
                for op in self.graph:
                    choices = mesh_space.mesh_configs(op, mesh)
                    configs[op.name] = rng.choice(choices)
                strategy = Strategy(configs)
                strategy.validate(self.graph, 8)
                found = MeshSpec.of(strategy, 8)
                self.assertIsNotNone(found, strategy)
                # The mesh found may be smaller or shaped otherwise, but
                # every config is on it.
                for config in strategy.values():
                    self.assertIsNotNone(found.axes(config))

    def test_copies(self):
        mesh = MeshSpec.first((2, 4))
        self.assertEqual(mesh.grid.tolist(), np.arange(8).reshape(2, 4).tolist())
        self.assertEqual(
            mesh_space.copies(ParallelConfig((4, 1), (0, 1, 2, 3)), mesh), 2
        )
        self.assertEqual(mesh_space.copies(ParallelConfig((1, 1), (0,)), mesh), 8)


class SearchMeshesTest(unittest.TestCase):
    def test_search_stays_on_one_mesh_and_beats_its_start(self):
        from flexflow_keras import machine, search, simulator

        graph = hand_graph(batch=8)
        sim = simulator.Simulator(graph, machine.load_machine("v100x4"))
        result = search.search_meshes(graph, sim, 4, budget=200, seed=1,
                                      verbose=0)
        self.assertEqual(result.iterations, 200)
        self.assertIsNotNone(MeshSpec.of(result.strategy, 4))
        for shape in mesh_space.mesh_shapes(4):
            start = mesh_space.mesh_data_parallel(graph, MeshSpec.first(shape))
            self.assertLessEqual(result.best_ms,
                                 sim.simulate(start).step_ms + 1e-9)
        self.assertAlmostEqual(result.best_ms,
                               sim.simulate(result.strategy).step_ms)

    def test_report_names_the_mesh_the_strategy_runs_on(self):
        """Searched on 2 x 2 with every op on the block of devices 0, 1,
        the strategy runs on the 1-D mesh of those two (`MeshSpec.of`),
        and the report says so, not the 2 x 2 it was searched on."""
        from flexflow_keras import search

        from test_search import FakeResult, FakeSimulator

        class OnTwo(FakeSimulator):
            """Fastest with every op split over devices 0, 1."""

            def cost(self, strategy):
                return FakeResult(sum(
                    abs(len(c.device_ids) - 2)
                    + (0 if c.device_ids == (0, 1) else 0.5)
                    for c in strategy.values()))

        graph = hand_graph(batch=8)
        lines = []
        result = search.search_meshes(
            graph, OnTwo(graph), 4, budget=200, seed=0, verbose=1,
            meshes=(MeshSpec.first((2, 2)),), print_fn=lines.append,
        )
        self.assertTrue(all(c.device_ids == (0, 1)
                            for c in result.strategy.values()))
        self.assertEqual(MeshSpec.of(result.strategy, 4),
                         MeshSpec((2,), (0, 1)))
        self.assertEqual(lines[0],
                         "Mesh (2,) over devices 0..1 (of 1 shapes weighed)")


class ShareAMeshTest(unittest.TestCase):
    """`share_a_mesh`: whether one DTensor mesh holds two configs, so a
    value moves between them by a relayout (`taskgraph.edge_piece`
    prices moves between meshes apart)."""

    def test_blocks_of_one_mesh_share_it(self):
        cases = [
            # Rows and columns over the same 4 devices: the 1-D mesh.
            ((4, 1), (0, 1, 2, 3), (1, 4), (0, 1, 2, 3)),
            # Two axes of a 2 x 2 mesh, each the block of its first row
            # or column.
            ((2, 1), (0, 1), (1, 2), (0, 2)),
            # Unsplit: replicated on any mesh with its device first.
            ((1, 1), (0,), (2, 2), (0, 1, 2, 3)),
            # On devices 0, 1 of a 4-device machine: the mesh 0..1.
            ((2, 1), (0, 1), (1, 2), (0, 1)),
        ]
        for dims_a, devices_a, dims_b, devices_b in cases:
            a = ParallelConfig(dims_a, devices_a)
            b = ParallelConfig(dims_b, devices_b)
            with self.subTest(a=a, b=b):
                self.assertTrue(mesh_space.share_a_mesh(a, b, 4))
                self.assertTrue(mesh_space.share_a_mesh(b, a, 4))

    def test_configs_on_no_common_mesh(self):
        cases = [
            # 16-way rows beside a 2 x 8 split: a layout shards a dim
            # over one axis, so no one mesh holds both.
            ((16, 1), tuple(range(16)), (2, 8), tuple(range(16)), 16),
            # Other devices (2, 3): no mesh over devices 0..k-1 has
            # them as its first block.
            ((2, 1), (0, 1), (2, 1), (2, 3), 4),
            # 4 devices in another order than any mesh's rows.
            ((4, 1), (0, 1, 2, 3), (4, 1), (0, 2, 1, 3), 4),
        ]
        for dims_a, devices_a, dims_b, devices_b, n in cases:
            a = ParallelConfig(dims_a, devices_a)
            b = ParallelConfig(dims_b, devices_b)
            with self.subTest(a=a, b=b):
                self.assertFalse(mesh_space.share_a_mesh(a, b, n))


if __name__ == "__main__":
    unittest.main()
