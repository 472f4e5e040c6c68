"""The task graph's pieces: what one op, one edge and one weight family
add to a step (tasks, resources, dependencies, bytes and memory)."""

import dataclasses
import unittest

from flexflow_keras import taskgraph
from flexflow_keras.cost import CostModel
from flexflow_keras.graph import ATTRIBUTE, SAMPLE, Op, OpGraph, TensorInfo
from flexflow_keras.machine import load_machine
from flexflow_keras.strategy import ParallelConfig
from test_simulator import chain, dense_graph

FLOAT = 4


class OpPieceTest(unittest.TestCase):
    def test_a_forward_and_a_backward_per_part(self):
        graph, m = chain(batch=8, features=100), load_machine("v100x4")
        op = graph.ops[0]
        config = ParallelConfig((4, 1), (0, 1, 2, 3))
        piece = taskgraph.op_piece(op, 0, config, CostModel(m), m)
        kinds = [label[0] for label in piece.labels]
        self.assertEqual(kinds, [taskgraph.FWD] * 4 + [taskgraph.BWD] * 4)
        self.assertEqual(piece.resources[:4], ((0,), (1,), (2,), (3,)))
        # Each backward follows its own part's forward.
        self.assertEqual(sorted(piece.deps),
                         [(taskgraph.SELF, i, taskgraph.SELF, 4 + i)
                          for i in range(4)])
        # Each part keeps its share of the output for backward.
        self.assertEqual(piece.memory_bytes,
                         tuple((d, 8 * 100 * FLOAT / 4) for d in range(4)))


class OverlapsTest(unittest.TestCase):
    def test_equal_to_every_pair_intersected(self):
        """Between configs on two meshes (`relaid` False, the default),
        `overlaps` (cached, in numpy) finds exactly the part pairs, in
        the order and with the sizes (both ways), of intersecting every
        producer part's rectangle with every consumer part's input
        region, over each edge of a CNN, a Transformer block, DLRM and
        an LSTM's state outputs (several ranks, parts that hold nothing,
        splits of every dim)."""
        import itertools

        import model_zoo

        from flexflow_keras import partition
        from flexflow_keras.keras_graph import build_graph

        def brute(producer, output, pdims, consumer, k, cdims):
            held = partition.tensor_rects(producer, output, pdims)
            found = []
            for i, rect in enumerate(partition.part_rects(
                    consumer.output_shape, cdims)):
                need = partition.input_region(consumer, k, rect)
                for j, have in enumerate(held):
                    common = None if have is None else partition.intersect(
                        have, need)
                    if common is not None:
                        size = partition.rect_size(common)
                        found.append((i, j, size, size))
            return tuple(found)

        def splits(rank):
            for d, n in itertools.product(range(rank), (1, 2, 4)):
                yield tuple(n if e == d else 1 for e in range(rank))
            if rank > 1:
                yield (2,) * 2 + (1,) * (rank - 2)

        import keras

        # An LSTM's state outputs (rank 2 beside its rank-3 sequence) are
        # held whole by its first part, by none of the others.
        tokens = keras.Input((5, 3))
        sequence, state, _ = keras.layers.LSTM(
            4, return_sequences=True, return_state=True)(tokens)
        states = keras.Model(tokens, [keras.layers.Dense(2)(sequence),
                                      keras.layers.Dense(2)(state)])
        checked = 0
        for model in (model_zoo.cnn(), model_zoo.transformer_block(),
                      model_zoo.dlrm(), states):
            graph = build_graph(model, 8)
            makers = {t: op for op in graph.ops for t in op.outputs}
            for consumer in graph.ops:
                for k, tensor in enumerate(consumer.inputs):
                    producer = makers.get(tensor)
                    if producer is None:
                        continue
                    output = producer.outputs.index(tensor)
                    for pdims in splits(len(producer.output_shape)):
                        for cdims in splits(len(consumer.output_shape)):
                            args = (producer, output, pdims, consumer, k,
                                    cdims)
                            self.assertEqual(taskgraph.overlaps(*args),
                                             brute(*args), args[2:])
                            checked += 1
        self.assertGreater(checked, 500)


def grid_chain(shape=(8, 100)):
    """x -> a -> b, elementwise ops of `shape` that may split every dim
    (each reads its input's slice of all of them)."""
    tensors = {"x": TensorInfo("x", shape, "float32")}
    ops, src = [], "x"
    splits = {d: ATTRIBUTE for d in range(1, len(shape))}
    for name in ("a", "b"):
        ops.append(Op(name, "Relu", (src,), (f"{name}:0",), (shape,),
                      (shape,), "float32",
                      partitionable={0: SAMPLE, **splits}))
        src = f"{name}:0"
        tensors[src] = TensorInfo(src, shape, "float32", name)
    return OpGraph(tuple(ops), tensors, ("x",), (src,), shape[0])


class GatheredMovesTest(unittest.TestCase):
    """A move between two layouts on the same devices is priced as
    DTensor runs it with its all-to-all relayouts off
    (`settings.all_gather_relayouts`): every dim whose split changes is
    gathered whole, then sliced on the device."""

    def setUp(self):
        self.graph, self.m = grid_chain(), load_machine("v100x4")
        self.a, self.b = self.graph.ops
        self.whole = 8 * 100 * FLOAT

    def piece(self, producer, consumer):
        return taskgraph.edge_piece(self.m, self.a, 0, producer, self.b, 1,
                                    consumer, 0)

    def collectives(self, piece, kind):
        """(devices, ms) of each collective of `kind` in `piece`."""
        return [(label[2].split(" over ")[1], ms)
                for label, ms in zip(piece.labels, piece.durations_ms)
                if label[0] == kind]

    def test_rows_to_columns_gathers_the_whole_tensor_both_ways(self):
        # Rows over 4 devices, then columns over the same 4: each device
        # reads a quarter of its rows' columns from each other device
        # (3/16 of the tensor), but DTensor gathers the rows first, so it
        # receives the three other quarters whole (3/4), and the
        # gradient's move back does the same: one all-gather of quarters
        # each way over the 4 devices' ring.
        devices = (0, 1, 2, 3)
        piece = self.piece(ParallelConfig((4, 1), devices),
                           ParallelConfig((1, 4), devices))
        self.assertEqual(piece.comm_bytes, 2 * 4 * 3 / 4 * self.whole)
        ring_ms, _ = taskgraph.ring_allgather_ms(self.m, devices,
                                                 self.whole / 4)
        for kind in (taskgraph.XFER_FWD, taskgraph.XFER_BWD):
            self.assertEqual(self.collectives(piece, kind),
                             [(str(devices), ring_ms)])
        # Each device keeps what it received for the step.
        self.assertEqual(sorted(piece.memory_bytes),
                         [(d, self.whole / 4) for d in devices for _ in
                          range(3)])

    def test_a_collective_waits_for_every_part_and_feeds_every_part(self):
        # Forward: the 4 producer parts' forward tasks before the gather,
        # the 4 consumer parts' forward tasks after it; backward: the
        # consumer parts' backward tasks (local 4..7) before, the
        # producer parts' after; and each part's own device's share as
        # a plain dependency each way.
        devices = (0, 1, 2, 3)
        piece = self.piece(ParallelConfig((4, 1), devices),
                           ParallelConfig((1, 4), devices))
        forward, backward = 0, 1  # the piece's two tasks, in order
        self.assertEqual(
            sorted(piece.deps),
            sorted([(0, k, taskgraph.SELF, forward) for k in range(4)]
                   + [(taskgraph.SELF, forward, 1, k) for k in range(4)]
                   + [(1, 4 + k, taskgraph.SELF, backward)
                      for k in range(4)]
                   + [(taskgraph.SELF, backward, 0, 4 + k)
                      for k in range(4)]
                   + [(0, k, 1, k) for k in range(4)]
                   + [(1, 4 + k, 0, 4 + k) for k in range(4)]))

    def test_a_ring_takes_a_step_per_other_device_on_its_slowest_hop(self):
        m = load_machine("p100x16")  # 4 nodes of 4: devices 3 -> 4 cross
        inside, _ = taskgraph.ring_allgather_ms(m, (0, 1, 2, 3), 1e6)
        across, links = taskgraph.ring_allgather_ms(m, (2, 3, 4, 5), 1e6)
        self.assertAlmostEqual(inside, 3 * m.route(0, 1).transfer_ms(1e6))
        self.assertAlmostEqual(across, 3 * m.route(3, 4).transfer_ms(1e6))
        self.assertTrue(set(m.route(3, 4).links) <= set(links))

    def test_a_kept_split_is_not_gathered(self):
        # An (8, 10, 10) tensor, rows over one axis of a 2 x 2 mesh and
        # columns over the other, then rows kept and the depth over the
        # second axis: only the columns are gathered, within each half of
        # the rows. Each part receives a quarter of the tensor (the part
        # beside it in its row half), where it reads an eighth.
        graph = grid_chain((8, 10, 10))
        a, b = graph.ops
        devices = (0, 1, 2, 3)
        piece = taskgraph.edge_piece(
            self.m, a, 0, ParallelConfig((2, 2, 1), devices), b, 1,
            ParallelConfig((2, 1, 2), devices), 0)
        whole = 8 * 10 * 10 * FLOAT
        self.assertEqual(piece.comm_bytes, 2 * 4 * whole / 4)

    def test_same_layout_moves_nothing(self):
        config = ParallelConfig((1, 4), (0, 1, 2, 3))
        piece = self.piece(config, config)
        self.assertEqual(piece.durations_ms, ())
        self.assertEqual(len(piece.deps), 8)

    def test_a_replicated_read_sends_partial_gradients_as_read(self):
        # The consumer reads its input whole on every part: forward an
        # all-gather (3/4 of the tensor to each device), backward each
        # part's partial gradient of a producer part's rows (a quarter
        # from each of the 3 other devices), as the regions met.
        producer = grid_chain().ops[0]
        dense = dataclasses.replace(dense_graph(batch=8, features=100,
                                                units=100).ops[0],
                                    inputs=("a:0",))
        devices = (0, 1, 2, 3)
        piece = taskgraph.edge_piece(
            self.m, producer, 0, ParallelConfig((4, 1), devices), dense, 1,
            ParallelConfig((1, 4), devices), 0)
        self.assertEqual(
            [label[0] for label in piece.labels],
            [taskgraph.XFER_FWD, taskgraph.XFER_BWD])
        self.assertEqual(piece.comm_bytes,
                         4 * 3 / 4 * self.whole + 4 * 3 / 4 * self.whole)

    def test_on_other_devices_each_part_gets_what_it_reads(self):
        # No consumer part shares a device with a producer part: each
        # receives its region from the parts holding it (the runtime
        # copies between meshes through a replicated value; unchanged).
        piece = self.piece(ParallelConfig((2, 1), (0, 1)),
                           ParallelConfig((1, 2), (2, 3)))
        self.assertEqual(piece.comm_bytes, 2 * self.whole)


class EdgePieceTest(unittest.TestCase):
    def setUp(self):
        self.graph, self.m = chain(batch=8, features=100), load_machine(
            "v100x4")
        self.a, self.b = self.graph.ops

    def piece(self, producer, consumer):
        return taskgraph.edge_piece(self.m, self.a, 0, producer, self.b, 1,
                                    consumer, 0)

    def test_same_split_same_devices_moves_nothing(self):
        config = ParallelConfig((4, 1), (0, 1, 2, 3))
        piece = self.piece(config, config)
        self.assertEqual(piece.durations_ms, ())
        self.assertEqual(piece.comm_bytes, 0.0)
        # Plain dependencies: forward a -> b, backward b -> a, per part.
        self.assertEqual(len(piece.deps), 8)

    def test_other_devices_move_each_part_both_ways(self):
        piece = self.piece(ParallelConfig((2, 1), (0, 1)),
                           ParallelConfig((2, 1), (2, 3)))
        kinds = sorted(label[0] for label in piece.labels)
        self.assertEqual(kinds, [taskgraph.XFER_FWD] * 2
                         + [taskgraph.XFER_BWD] * 2)
        half = 4 * 100 * FLOAT
        self.assertEqual(piece.comm_bytes, 2 * 2 * half)
        self.assertEqual(sorted(piece.memory_bytes),
                         [(2, half), (3, half)])
        self.assertTrue(all(ms > 0 for ms in piece.durations_ms))

    def test_regrouping_moves_only_the_intersections(self):
        # a split in 2 on 0,1; b split in 4 on 0..3: b's parts 0 and 2
        # find their rows on their own device, 1 and 3 fetch them. Two
        # meshes: priced as FlexFlow's regions (`taskgraph.one_mesh`).
        piece = self.piece(ParallelConfig((2, 1), (0, 1)),
                           ParallelConfig((4, 1), (0, 2, 1, 3)))
        quarter = 2 * 100 * FLOAT
        self.assertEqual(piece.comm_bytes, 2 * 2 * quarter)


def region_transfers_one_by_one(machine, producer, p, pc, consumer, c, cc,
                                 k):
    """What `edge_piece` builds between two meshes, by its rule written
    as a loop over `overlaps`' rows: per row on two devices a forward
    transfer (if it moves elements) then a backward one, each between
    the parts' tasks, else a plain dependency each way."""
    tensor = consumer.inputs[k]
    rows = taskgraph.overlaps(producer, producer.outputs.index(tensor),
                              pc.dims, consumer, k, cc.dims)
    n_p, n_c = pc.num_parts, cc.num_parts
    dur, res, prio, labels, deps, memory = [], [], [], [], [], []
    comm = 0
    for i, j, forward, backward in rows:
        dst, src = cc.device_ids[i], pc.device_ids[j]
        for kind, frm, to, elements, after, before in (
            (taskgraph.XFER_FWD, src, dst, forward, (p, j), (c, i)),
            (taskgraph.XFER_BWD, dst, src, backward, (c, n_c + i),
             (p, n_p + j)),
        ):
            if src == dst or not elements:
                deps.append(after + before)
                continue
            num_bytes = elements * FLOAT
            t = len(dur)
            dur.append(machine.copy_route(frm, to).transfer_ms(num_bytes))
            res.append(machine.link_resources(machine.route(frm, to).links))
            prio.append(taskgraph.priority(c, kind, (k << 12) | i, j))
            labels.append((kind, consumer.name, (tensor, frm, to)))
            deps += [after + (taskgraph.SELF, t), (taskgraph.SELF, t) + before]
            if kind == taskgraph.XFER_FWD:
                memory.append((to, float(num_bytes)))
            comm += num_bytes
    return taskgraph.Piece(tuple(dur), tuple(res), tuple(prio),
                           tuple(labels), tuple(deps), (), tuple(memory),
                           float(comm))


class RegionTransfersTest(unittest.TestCase):
    def test_equal_to_the_rule_row_by_row(self):
        """Between random configs on two meshes, on two nodes (routes over
        NICs) with copy figures inside a node, the piece built in arrays
        is, field by field and in order, the rule's loop: durations,
        resources, priorities, labels, dependencies, memory and bytes."""
        import random

        from flexflow_keras.machine import LinkGroup, MachineModel

        base = load_machine("v100x4")
        machine = MachineModel(
            "two", base.devices[0], 2, 4, LinkGroup("host", 10.0, 0.01),
            LinkGroup("ethernet", 1.0, 0.5), copy=(0.05, 4.0),
        )
        graph = grid_chain((8, 12, 6))
        a, b = graph.ops
        rng = random.Random(0)

        splits = [(x, y, z) for x in (1, 2, 4, 8) for y in (1, 2, 4)
                  for z in (1, 2) if x * y * z <= 8]

        def config():
            dims = rng.choice(splits)
            n = dims[0] * dims[1] * dims[2]
            return ParallelConfig(dims, tuple(rng.sample(range(8), n)))

        checked = moved = 0
        while checked < 200:
            pc, cc = config(), config()
            if taskgraph.one_mesh(pc, cc):
                continue
            piece = taskgraph.edge_piece(machine, a, 3, pc, b, 5, cc, 0)
            expected = region_transfers_one_by_one(machine, a, 3, pc, b, 5,
                                                   cc, 0)
            for field in dataclasses.fields(taskgraph.Piece):
                if field.compare:
                    self.assertEqual(getattr(piece, field.name),
                                     getattr(expected, field.name),
                                     (field.name, pc, cc))
            checked += 1
            moved += bool(piece.durations_ms)
        self.assertGreater(moved, 150)


class FamilyPieceTest(unittest.TestCase):
    def family(self, dims, slots):
        """(task kinds, piece) of a 100x100 Dense's weights on 4 devices."""
        graph = dense_graph(batch=8, features=100, units=100)
        m = load_machine("v100x4")
        config = ParallelConfig(dims, (0, 1, 2, 3))
        piece = taskgraph.family_piece(
            m, CostModel(m), [(graph.ops[0], 0, config)], slots
        )
        return [label[0] for label in piece.labels], piece

    def test_replicated_weights_all_reduce_then_update_everywhere(self):
        kinds, piece = self.family((4, 1), slots=2)
        self.assertEqual(kinds.count(taskgraph.SYNC), 1)
        self.assertEqual(kinds.count(taskgraph.UPDATE), 4)
        weight_bytes = (100 * 100 + 100) * FLOAT
        self.assertEqual(piece.comm_bytes, 2 * 3 * weight_bytes)
        # Weights, gradients and two optimizer slots on every device.
        self.assertEqual(sorted(piece.memory_bytes),
                         [(d, weight_bytes * 4) for d in range(4)])

    def test_split_weights_need_no_sync(self):
        kinds, piece = self.family((1, 4), slots=0)
        self.assertNotIn(taskgraph.SYNC, kinds)
        self.assertEqual(kinds.count(taskgraph.UPDATE), 4)
        self.assertEqual(piece.comm_bytes, 0.0)

    def test_ring_allreduce_time_grows_with_bytes_and_devices(self):
        m = load_machine("p100x16")
        small, _ = taskgraph.ring_allreduce_ms(m, (0, 1), 1e6)
        large, _ = taskgraph.ring_allreduce_ms(m, (0, 1), 1e8)
        across, links = taskgraph.ring_allreduce_ms(m, (0, 4), 1e8)
        self.assertLess(small, large)
        self.assertLess(large, across)  # 0 and 4 sit on different nodes
        self.assertTrue(links)


if __name__ == "__main__":
    unittest.main()


class ReplicatedMovesTest(unittest.TestCase):
    """`between_meshes="replicated"`: a move between two meshes as one
    DTensor function makes it (`copy_to_mesh` copies replicated layouts,
    or sharded ones one to one), which `bench/one_function_bench.py`
    prices the several-mesh route by."""

    def setUp(self):
        self.graph, self.m = grid_chain(), load_machine("v100x4")
        self.a, self.b = self.graph.ops
        self.whole = 8 * 100 * FLOAT

    def piece(self, producer, consumer, between_meshes):
        return taskgraph.edge_piece(self.m, self.a, 0, producer, self.b, 1,
                                    consumer, 0, between_meshes)

    def test_two_views_of_the_same_devices_gather_the_whole_tensor(self):
        # Rows over the 1-D mesh 0..3; rows and columns over a 2 x 2 view
        # of the same devices: no one mesh holds both.
        rows = ParallelConfig((4, 1), (0, 1, 2, 3))
        grid = ParallelConfig((2, 2), (0, 1, 2, 3))
        regions = self.piece(rows, grid, "regions")
        gathered = self.piece(rows, grid, "replicated")
        # Each device receives the 3 quarters it does not hold, each way
        # (its gradient back alike: every consumer part's region, a
        # quarter here), as one collective per direction.
        self.assertEqual(gathered.comm_bytes, 2 * 4 * 3 * self.whole / 4)
        self.assertEqual(sorted(label[0] for label in gathered.labels),
                         [taskgraph.XFER_FWD, taskgraph.XFER_BWD])
        # The regions met: a part reads an eighth, half of it elsewhere.
        self.assertLess(regions.comm_bytes, gathered.comm_bytes / 4)

    def test_other_devices_receive_every_part(self):
        # 2 parts on devices 0, 1 to 4 parts on 0..3 in another order.
        piece = self.piece(ParallelConfig((2, 1), (0, 1)),
                           ParallelConfig((1, 4), (0, 2, 1, 3)),
                           "replicated")
        half = self.whole / 2
        kinds = [label[0] for label in piece.labels]
        # Parts on devices 2 and 3 receive both halves, those on 0 and 1
        # the half their device does not hold; each gradient goes back.
        self.assertEqual(kinds.count(taskgraph.XFER_FWD), 6)
        self.assertEqual(kinds.count(taskgraph.XFER_BWD), 6)
        self.assertEqual(sorted(piece.memory_bytes),
                         [(0, half), (1, half), (2, half), (2, half),
                          (3, half), (3, half)])

    def test_moves_one_mesh_holds_or_copies_one_to_one_are_unchanged(self):
        cases = [
            # Relaid on one mesh (`one_mesh`).
            (ParallelConfig((4, 1), (0, 1, 2, 3)),
             ParallelConfig((1, 4), (0, 1, 2, 3))),
            # Two blocks of one 2 x 2 mesh (`share_a_mesh`).
            (ParallelConfig((2, 1), (0, 1)), ParallelConfig((1, 2), (0, 2))),
            # The same split on other devices: copied one to one.
            (ParallelConfig((2, 1), (0, 1)), ParallelConfig((2, 1), (2, 3))),
        ]
        for producer, consumer in cases:
            with self.subTest(producer=producer, consumer=consumer):
                self.assertEqual(
                    self.piece(producer, consumer, "replicated"),
                    self.piece(producer, consumer, "regions"),
                )

    def test_unknown_pricing_is_refused(self):
        config = ParallelConfig((4, 1), (0, 1, 2, 3))
        with self.assertRaisesRegex(ValueError, "between_meshes"):
            self.piece(config, config, "all-to-all")
