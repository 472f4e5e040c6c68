"""Strategy files: FlexFlow protobuf (.pb) and text (.txt) round trips,
and clear errors for every kind of bad file."""

import os
import tempfile
import unittest
import warnings

import keras

from flexflow_keras import strategy_files
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.strategy_files import load_strategy, save_strategy


def mlp_graph(batch: int = 8, prefix: str = "dense"):
    inputs = keras.Input(shape=(4,), name="x")
    x = inputs
    for i, n in enumerate((6, 6, 2)):
        x = keras.layers.Dense(n, name=f"{prefix}_{i}")(x)
    return build_graph(keras.Model(inputs, x), batch)


class StrategyFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = mlp_graph()
        cls.strategy = Strategy({
            "dense_0": ParallelConfig((2, 1), (3, 1)),
            "dense_1": ParallelConfig((1, 3), (0, 2, 1)),
            "dense_2": ParallelConfig((1, 1), (2,)),
        })

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def path(self, name: str) -> str:
        return os.path.join(self.dir.name, name)

    def write(self, name: str, data: bytes | str) -> str:
        mode = "wb" if isinstance(data, bytes) else "w"
        with open(self.path(name), mode) as f:
            f.write(data)
        return self.path(name)

    def test_round_trip_both_forms(self):
        for name in ("s.pb", "s.txt"):
            save_strategy(self.strategy, self.path(name))
            loaded = load_strategy(self.path(name), self.graph, 4)
            self.assertEqual(loaded, self.strategy)
            self.assertEqual(list(loaded), list(self.strategy))

    def test_text_form_is_flexflow_lines(self):
        save_strategy(self.strategy, self.path("s.txt"))
        with open(self.path("s.txt")) as f:
            lines = f.read().splitlines()
        self.assertEqual(lines[0], "# flexflow_keras strategy: 3 ops")
        self.assertEqual(
            lines[2], "[dense_1] num_dims(2) dims[1,3] device_ids[0,2,1]"
        )

    def test_binary_is_flexflow_schema(self):
        save_strategy(self.strategy, self.path("s.pb"))
        proto = strategy_files.StrategyProto()
        with open(self.path("s.pb"), "rb") as f:
            proto.ParseFromString(f.read())
        self.assertEqual(proto.DESCRIPTOR.full_name, "FFProtoBuf.Strategy")
        self.assertEqual(
            [(o.name, list(o.dims), list(o.device_ids)) for o in proto.ops],
            [("dense_0", [2, 1], [3, 1]), ("dense_1", [1, 3], [0, 2, 1]),
             ("dense_2", [1, 1], [2])],
        )
        self.assertEqual(proto.ops[0].device_type, 0)  # GPU

    def test_reads_flexflow_file_without_header(self):
        proto = strategy_files.StrategyProto()
        for name, config in self.strategy.items():
            proto.ops.add(name=name, device_type="GPU", dims=config.dims,
                          device_ids=config.device_ids,
                          memory_types=["FBM"] * config.num_parts)
        path = self.write("ff.pb", proto.SerializeToString())
        self.assertEqual(load_strategy(path, self.graph, 4), self.strategy)

    def test_every_truncation_is_an_error(self):
        save_strategy(self.strategy, self.path("s.pb"))
        with open(self.path("s.pb"), "rb") as f:
            data = f.read()
        for cut in range(len(data)):
            path = self.write("cut.pb", data[:cut])
            with self.assertRaisesRegex(
                ValueError, "cut.pb.*(truncated|corrupt|no ops)"
            ):
                load_strategy(path, self.graph, 4)

    def test_every_bit_flip_is_an_error(self):
        save_strategy(self.strategy, self.path("s.pb"))
        with open(self.path("s.pb"), "rb") as f:
            data = f.read()
        for i in range(len(data)):
            for bit in range(8):
                bad = bytearray(data)
                bad[i] ^= 1 << bit
                with self.assertRaises(ValueError):
                    strategy_files.parse_bytes(bytes(bad))

    def test_truncated_text_is_an_error(self):
        save_strategy(self.strategy, self.path("s.txt"))
        with open(self.path("s.txt")) as f:
            text = f.read()
        cut_line = self.write("a.txt", text[: text.rindex("\n[")])
        with self.assertRaisesRegex(ValueError, "promises 3 ops.*holds 2"):
            load_strategy(cut_line, self.graph, 4)
        cut_mid = self.write("b.txt", text[:-8])
        with self.assertRaisesRegex(ValueError, "line 4 is not a strategy"):
            load_strategy(cut_mid, self.graph, 4)

    def test_garbage_is_an_error_not_a_crash(self):
        path = self.write("g.pb", os.urandom(64) + b"\xff" * 8)
        with self.assertRaisesRegex(ValueError, "g.pb"):
            load_strategy(path, self.graph, 4)
        path = self.write("g.txt", b"\xff\xfe\x00binary")
        with self.assertRaisesRegex(ValueError, "not UTF-8"):
            load_strategy(path, self.graph, 4)

    def test_empty_file_is_an_error(self):
        for name in ("e.pb", "e.txt"):
            path = self.write(name, b"")
            with self.assertRaisesRegex(ValueError, "holds no ops"):
                load_strategy(path, self.graph, 4)

    def test_file_for_another_model(self):
        save_strategy(self.strategy, self.path("s.pb"))
        other = mlp_graph(prefix="fc")
        with self.assertRaisesRegex(
            ValueError, "names ops the model lacks.*another model"
        ):
            load_strategy(self.path("s.pb"), other, 4)

    def test_devices_the_machine_lacks(self):
        save_strategy(self.strategy, self.path("s.txt"))
        with self.assertRaisesRegex(
            ValueError, "s.txt.*'dense_0' names devices.*2 devices"
        ):
            load_strategy(self.path("s.txt"), self.graph, 2)

    def test_config_the_op_cannot_take(self):
        path = self.write(
            "bad.txt", "[dense_2] num_dims(2) dims[1,4] device_ids[0,1,2,3]\n"
        )
        with self.assertRaisesRegex(ValueError, "bad.txt.*'dense_2'.*size 2"):
            load_strategy(path, self.graph, 4)

    def test_inconsistent_line_names_op(self):
        path = self.write(
            "bad.txt", "[dense_2] num_dims(2) dims[2,1] device_ids[0]\n"
        )
        with self.assertRaisesRegex(ValueError, "line 1: op 'dense_2'"):
            load_strategy(path, self.graph, 4)

    def test_missing_ops_take_data_parallelism_with_one_warning(self):
        path = self.write(
            "part.txt", "[dense_1] num_dims(2) dims[1,1] device_ids[3]\n"
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_strategy(path, self.graph, 4)
        self.assertEqual(len(caught), 1)
        self.assertIn("['dense_0', 'dense_2']", str(caught[0].message))
        expected = Strategy.data_parallel(self.graph, 4).replace(
            "dense_1", ParallelConfig((1, 1), (3,))
        )
        self.assertEqual(loaded, expected)

    def test_unknown_extension(self):
        with self.assertRaisesRegex(ValueError, "extension.*s.json"):
            save_strategy(self.strategy, self.path("s.json"))

    def test_missing_file(self):
        with self.assertRaisesRegex(ValueError, "does not exist"):
            load_strategy(self.path("nope.pb"), self.graph, 4)
