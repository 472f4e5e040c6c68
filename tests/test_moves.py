"""Moves between meshes (`runtime/moves.py`): each device receives the
region it reads, which is what the simulator prices between meshes."""

import random
import unittest

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import model_zoo
from flexflow_keras import devices, search_space, taskgraph
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import layouts, moves
from flexflow_keras.runtime.moves import replicate

U = dtensor.UNSHARDED


def _mesh(shape, ids):
    names = devices.device_names()
    return layouts.MeshCache(names).get(shape, ids)


def _value(x, layout):
    """`x` laid out on `layout` by DTensor itself."""
    packed = replicate(x, layout.mesh)
    if layout.is_fully_replicated():
        return packed
    return dtensor.relayout(packed, layout)


class MoveTest(unittest.TestCase):
    def setUp(self):
        self.x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
        self.rows = dtensor.Layout(["a0", U], _mesh((2,), (0, 1)))
        grid = _mesh((2, 2), (0, 1, 2, 3))
        self.targets = [
            dtensor.Layout([U, "a0"], _mesh((2,), (2, 3))),   # columns
            dtensor.Layout(["a1", "a0"], grid),                # 2 x 2
            dtensor.Layout(["a0", U], grid),                   # rows, copies
            dtensor.Layout.replicated(_mesh((4,), (0, 1, 2, 3)), 2),
            dtensor.Layout(["a0", U], _mesh((2,), (1, 0))),    # swapped
        ]

    def _check_parts(self, moved, layout):
        """Each part holds exactly its block of `x`, on its device."""
        self.assertEqual(dtensor.fetch_layout(moved), layout)
        grid = moves.grid_of(layout, self.x.shape)
        parts = dtensor.unpack(moved)
        for n, (part, device) in enumerate(zip(parts,
                                               layout.mesh.local_devices())):
            (r0, r1), (c0, c1) = grid.region(n)
            np.testing.assert_array_equal(part.numpy(),
                                          self.x[r0:r1, c0:c1])
            self.assertEqual(tf.DeviceSpec.from_string(part.device),
                             tf.DeviceSpec.from_string(device))

    def test_each_part_is_its_block(self):
        """From rows on devices 0-1 to columns on 2-3, to blocks of a
        2 x 2 mesh, to rows copied over a mesh axis, to replicated, to
        the same rows on swapped devices; and back to rows."""
        value = _value(self.x, self.rows)
        for layout in self.targets:
            with self.subTest(layout=layout.to_string()):
                moved = moves.move(value, layout)
                self._check_parts(moved, layout)
                self._check_parts(moves.move(moved, self.rows), self.rows)

    def test_a_regular_tensor_is_packed_whole_and_gathered_back(self):
        """A batch input or the loss's gradient goes whole onto each
        device (one `pack`); the function reading it slices it there."""
        for layout in self.targets:
            moved = moves.move(tf.constant(self.x), layout)
            self.assertTrue(dtensor.fetch_layout(moved).is_fully_replicated())
            self.assertEqual(dtensor.fetch_layout(moved).mesh, layout.mesh)
            np.testing.assert_array_equal(
                moves.gathered([moved])[0].numpy(), self.x)

    def test_gathered_whole(self):
        value = _value(self.x, self.rows)
        split = [moves.move(value, layout) for layout in self.targets]
        for whole in moves.gathered(split + [tf.constant(self.x)]):
            np.testing.assert_array_equal(whole.numpy(), self.x)

    def test_sum_and_zeros_part_by_part(self):
        layout = self.targets[1]
        value = moves.move(_value(self.x, self.rows), layout)
        self.x = 2 * self.x
        self._check_parts(moves.added(value, value), layout)
        self.x = np.zeros_like(self.x)
        self._check_parts(moves.zeros_like(value), layout)

    def test_one_mesh_is_left_to_dtensor(self):
        """On the value's own mesh the move is DTensor's relayout (what
        the simulator prices there: gathers); the same layout, no op."""
        value = _value(self.x, self.rows)
        self.assertIs(moves.move(value, self.rows), value)
        columns = dtensor.Layout([U, "a0"], self.rows.mesh)
        self._check_parts(moves.move(value, columns), columns)

    def test_replicated_source_is_read_from_its_own_device(self):
        """A piece several source parts hold comes from the destination's
        own device where it holds one (no copy), else from the holders in
        turn."""
        src = moves.Grid((8,), (2,), ((0,), (0,), (1,), (1,)))
        dst = moves.Grid((8,), (4,), ((0,), (1,), (2,), (3,)))
        plan = moves.copy_plan(src, dst, ["0", "1", "2", "3"],
                               ["1", "9", "8", "2"])
        self.assertEqual([[p.source for p in pieces] for pieces in plan],
                         [[1], [0], [2], [2]])
        self.assertEqual(moves.moved_elements(
            plan, ["0", "1", "2", "3"], ["1", "9", "8", "2"]), 4)

    def test_shape_mismatch_is_named(self):
        with self.assertRaisesRegex(ValueError, "shape"):
            moves.copy_plan(moves.whole((4,)), moves.whole((5,)), ["0"],
                            ["0"])


def _edges_between_meshes():
    """(producer, output index, consumer, input index, producer config,
    consumer config, the executor's layout of the producer's output and
    of the consumer's input, the input's shape) for every edge between
    two meshes of 6 random strategies each of a CNN, a Transformer
    block and DLRM on the attached devices."""
    names = devices.device_names()
    meshes = layouts.MeshCache(names)
    rng = random.Random(0)
    for model in (model_zoo.cnn(), model_zoo.transformer_block(),
                  model_zoo.dlrm()):
        graph = build_graph(model, 8)
        for _ in range(6):
            strategy = search_space.random_strategy(graph, len(names), rng)
            try:
                plans = {p.op.name: p for p in layouts.plan_ops(
                    graph, strategy, meshes)}
            except (ValueError, NotImplementedError):
                continue  # untied shared calls: refused, not moved
            for consumer in graph.ops:
                for k, tensor in enumerate(consumer.inputs):
                    producer = graph.producer(tensor)
                    if producer is None:
                        continue
                    source = strategy[producer.name]
                    sink = strategy[consumer.name]
                    if taskgraph.one_mesh(source, sink):
                        continue
                    out = producer.outputs.index(tensor)
                    shape = tuple(consumer.input_shapes[k])
                    yield (producer, out, consumer, k, source, sink,
                           plans[producer.name].output_layout(
                               out, len(shape), True),
                           plans[consumer.name].input_layout(
                               k, shape, True),
                           shape)


class SimulatorPricesTheMoveTest(unittest.TestCase):
    def test_copied_elements_equal_the_simulated_regions(self):
        """For every edge between two meshes of random strategies of a
        CNN, a Transformer block and DLRM, the elements the runtime
        copies from other devices (`copy_plan` between the layouts the
        executor gives the producer's output and the consumer's input)
        equal those the simulator's region transfers move
        (`taskgraph.overlaps`)."""
        checked = 0
        for (producer, out, consumer, k, source, sink, src_layout,
             dst_layout, shape) in _edges_between_meshes():
            src_names = src_layout.mesh.local_devices()
            dst_names = dst_layout.mesh.local_devices()
            plan = moves.copy_plan(
                moves.grid_of(src_layout, shape),
                moves.grid_of(dst_layout, shape),
                src_names, dst_names)
            copied = moves.moved_elements(plan, src_names, dst_names)
            priced = sum(
                forward for i, j, forward, _ in
                taskgraph.overlaps(producer, out, source.dims,
                                   consumer, k, sink.dims)
                if sink.device_ids[i] != source.device_ids[j])
            self.assertEqual(copied, priced,
                             (producer.name, consumer.name, source, sink))
            checked += 1
        self.assertGreater(checked, 30)

    def test_the_byte_bench_cuts_as_the_executor_lays_out(self):
        """`bench/cross_mesh_bench.py` counts 16- and 64-device strategies
        without building their meshes, from a pure-Python mirror of how
        a config's mesh cuts a tensor (`config_grid`); on the attached
        devices its grids equal those of the executor's real layouts."""
        import cross_mesh_bench
        from flexflow_keras import partition

        checked = 0
        for (producer, out, consumer, k, source, sink, src_layout,
             dst_layout, shape) in _edges_between_meshes():
            out_split = {d for d in range(len(shape)) if out == 0 or d == 0}
            self.assertEqual(
                cross_mesh_bench.config_grid(shape, source.dims, out_split),
                moves.grid_of(src_layout, shape), (producer.name, source))
            self.assertEqual(
                cross_mesh_bench.config_grid(
                    shape, sink.dims,
                    partition.split_input_dims(consumer, k, shape)),
                moves.grid_of(dst_layout, shape), (consumer.name, sink))
            checked += 1
        self.assertGreater(checked, 30)


class ExecutorMovesRegionsTest(unittest.TestCase):
    def test_segments_receive_what_their_first_reader_reads(self):
        """Under ops alternating between devices (0, 1) and (2, 3), each
        splitting the batch, every segment's inputs made by another
        segment arrive split as their first reader reads them (until
        2026-11-29 they arrived whole on every device; the batch input
        still does, sliced inside), and the model trains as plain Keras
        does."""
        import runtime_support as support

        ref, model = support.build_pair("mlp")
        support.attach(model, support.several_meshes, 8)
        _, data, _ = support.MODELS["mlp"]
        x, y = data(32)
        h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0)
        h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                      verbose=0)
        support.assert_same_training(self, ref, model, h_ref, h)
        executor = model.strategy_executor
        self.assertGreater(len(executor.segments), 2)
        variant = executor._variant(8)
        _, seg_inputs = executor._forward_all(
            executor._flat_inputs(x[:8]), False, variant)
        for index, (seg, ins) in enumerate(zip(executor.segments,
                                               seg_inputs)):
            for name, value in zip(seg.inputs, ins):
                layout = dtensor.fetch_layout(value)
                if name in executor.graph.inputs:
                    self.assertTrue(layout.is_fully_replicated())
                    continue
                self.assertEqual(layout.sharding_specs[0], "a0", name)
                self.assertEqual(
                    layout, executor._arrival(index, name, value, True))


if __name__ == "__main__":
    unittest.main()
