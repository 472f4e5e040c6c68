"""MachineModel: presets, routes, JSON specs, live devices."""

import json
import unittest

from flexflow_keras.machine import (
    GIB, PRESETS, load_machine, machine_from_dict,
)


def spec_dict(**overrides):
    spec = {
        "name": "tiny",
        "num_nodes": 2,
        "devices_per_node": 2,
        "device": {"kind": "X1", "peak_tflops": 1.0, "memory_gib": 1.0,
                   "memory_gbps": 100.0},
        "intra_node": {"kind": "nvlink", "bandwidth_gbps": 10.0,
                       "latency_us": 1.0},
        "inter_node": {"bandwidth_gbps": 1.0, "latency_us": 4.0},
    }
    spec.update(overrides)
    return spec


class PresetTest(unittest.TestCase):
    def test_presets_have_the_papers_shapes(self):
        shapes = {
            "p100x16": (4, 4, "P100", "nvlink"),
            "k80x64": (16, 4, "K80", "pcie"),
            "v100x4": (1, 4, "V100", "nvlink"),
            "h100x8": (1, 8, "H100", "nvswitch"),
            "h100x64": (8, 8, "H100", "nvswitch"),
        }
        self.assertEqual(set(shapes), set(PRESETS))
        for name, (nodes, per, kind, intra) in shapes.items():
            m = load_machine(name)
            self.assertEqual(m.num_devices, nodes * per)
            self.assertEqual(m.num_nodes, nodes)
            self.assertEqual(m.devices[0].kind, kind)
            self.assertEqual(m.intra.kind, intra)
            self.assertEqual(m.devices[-1].node, nodes - 1)

    def test_p100_routes_nvlink_inside_infiniband_across(self):
        m = load_machine("p100x16")
        inside, across = m.route(0, 1), m.route(0, 4)
        self.assertEqual(len(inside.links), 1)
        self.assertEqual(inside.bandwidth_gbps, 20.0)
        self.assertEqual(len(across.links), 2)
        self.assertEqual(across.bandwidth_gbps, 12.5)  # 100 Gb/s EDR
        self.assertEqual(m.links[across.links[0]].kind, "nic")

    def test_nvlink_pairs_have_their_own_links(self):
        m = load_machine("v100x4")
        self.assertNotEqual(m.route(0, 1).links, m.route(0, 2).links)
        self.assertNotEqual(m.route(0, 1).links, m.route(1, 0).links)

    def test_h100x64_has_a_nic_per_gpu(self):
        m = load_machine("h100x64")
        self.assertNotEqual(m.route(0, 8).links, m.route(1, 9).links)
        self.assertEqual(m.route(0, 8).bandwidth_gbps, 50.0)  # 400 Gb/s

    def test_machine_is_read_only(self):
        with self.assertRaisesRegex(AttributeError, "Received: name="):
            load_machine("v100x4").name = "other"

    def test_k80_nodes_share_one_nic(self):
        m = load_machine("k80x64")
        self.assertEqual(m.route(0, 4).links[0], m.route(1, 5).links[0])


class SpecFileTest(unittest.TestCase):
    def test_json_file_round_trip(self):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".json",
                                         delete=False) as f:
            json.dump(spec_dict(), f)
        m = load_machine(f.name)
        self.assertEqual(m.num_devices, 4)
        self.assertEqual(m.devices[0].peak_flops, 1e12)
        self.assertEqual(m.devices[0].memory_bytes, GIB)
        route = m.route(0, 2)
        self.assertAlmostEqual(route.latency_ms, 0.008)
        self.assertAlmostEqual(route.transfer_ms(1e6), 0.008 + 1.0)

    def test_unknown_key_is_named(self):
        with self.assertRaisesRegex(ValueError, "unknown keys \\['gpus'\\]"):
            machine_from_dict(spec_dict(gpus=3))

    def test_several_nodes_need_inter_node(self):
        spec = spec_dict()
        del spec["inter_node"]
        with self.assertRaisesRegex(ValueError, "Received: num_nodes=2"):
            machine_from_dict(spec)

    def test_unknown_preset(self):
        with self.assertRaisesRegex(ValueError, "Received: machine='a100'"):
            load_machine("a100")


class LiveMachineTest(unittest.TestCase):
    def test_live_machine_is_the_virtual_cpus(self):
        m = load_machine(None)
        self.assertTrue(m.live)
        self.assertGreaterEqual(m.num_devices, 1)
        self.assertEqual(m.devices[0].kind, "CPU")

    def test_a_relayout_is_priced_as_the_all_gather_the_links_fit(self):
        m = load_machine(None)
        if m.allreduce is None:
            self.skipTest("calibration turned off: nominal figures")
        link = m.links[0]
        self.assertEqual(m.allgather, (link.latency_ms, link.bandwidth_gbps))


if __name__ == "__main__":
    unittest.main()
