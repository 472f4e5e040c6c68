"""Every file in `strategies/` loads against its example's model.

The files are what `bench/search_bench.py --export-dir strategies` found
for the examples at full size on the paper's machines; a change to an
example, to the graph builder or to what an op may split must come with
re-exported files (the README says how), or this fails.
"""

import os
import unittest

import model_zoo
from flexflow_keras.machine import load_machine
from flexflow_keras.strategy_files import load_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SavedStrategiesTest(unittest.TestCase):
    def test_each_file_loads_against_its_example(self):
        bench = model_zoo.load_script("bench/search_bench.py")
        folder = os.path.join(ROOT, "strategies")
        files = sorted(f for f in os.listdir(folder)
                       if f.endswith((".txt", ".pb")))
        cases = {
            f"{example}_{machine}": name
            for name, (example, machine, _) in bench.CASES.items()
        }
        self.assertEqual(
            sorted({os.path.splitext(f)[0] for f in files}), sorted(cases)
        )
        graphs, loaded = {}, {}
        for file in files:
            stem = os.path.splitext(file)[0]
            with self.subTest(file):
                name = cases[stem]
                machine = load_machine(bench.CASES[name][1])
                if stem not in graphs:
                    graphs[stem] = bench.case_graph(name)
                strategy = load_strategy(os.path.join(folder, file),
                                         graphs[stem], machine.num_devices)
                self.assertEqual(set(strategy), {op.name
                                                 for op in graphs[stem]})
                # The .txt and the .pb of one search hold one strategy.
                self.assertEqual(loaded.setdefault(stem, strategy), strategy)


if __name__ == "__main__":
    unittest.main()
