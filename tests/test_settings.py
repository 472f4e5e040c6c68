"""Flag resolution: compile kwargs > command line > environment > default."""

import os
import tempfile
import unittest

from flexflow_keras import settings


class TakeFlagsTest(unittest.TestCase):
    def test_removes_only_our_flags(self):
        argv = ["train.py", "--epochs", "3", "--budget", "50",
                "--search-alpha=0.1", "--lr", "0.01", "--export", "s.pb"]
        found = settings.take_flags(argv)
        self.assertEqual(argv, ["train.py", "--epochs", "3", "--lr", "0.01"])
        self.assertEqual(
            found,
            {"search_budget": 50, "search_alpha": 0.1,
             "export_strategy": "s.pb"},
        )

    def test_long_and_short_names_agree(self):
        for short, long in (("--budget", "--search-budget"),
                            ("--alpha", "--search-alpha"),
                            ("--import", "--import-strategy"),
                            ("--export", "--export-strategy")):
            a = settings.take_flags(["x", short, "7"])
            b = settings.take_flags(["x", f"{long}=7"])
            self.assertEqual(a, b)

    def test_bad_value_names_flag_and_value(self):
        with self.assertRaisesRegex(ValueError, "--budget.*Received: 'lots'"):
            settings.take_flags(["x", "--budget", "lots"])

    def test_missing_value_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "`--budget` needs a value"):
            settings.take_flags(["x", "--budget"])

    def test_argparse_sees_only_its_flags(self):
        import argparse

        argv = ["x", "--cpu-devices", "2", "--epochs", "4"]
        settings.take_flags(argv)
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int)
        self.assertEqual(parser.parse_args(argv[1:]).epochs, 4)


class ResolveTest(unittest.TestCase):
    def test_defaults(self):
        resolved = settings.resolve({}, command_line={}, environ={})
        self.assertIsNone(resolved.search_alpha)  # the relative rule
        self.assertIsNone(resolved.import_strategy)

    def test_precedence(self):
        environ = {"FLEXFLOW_KERAS_SEARCH_BUDGET": "10",
                   "FLEXFLOW_KERAS_SEARCH_ALPHA": "0.5",
                   "FLEXFLOW_KERAS_MACHINE": "v100x4"}
        command_line = {"search_budget": 20, "search_alpha": 0.7}
        resolved = settings.resolve(
            {"search_budget": 30, "search_alpha": None},
            command_line=command_line, environ=environ,
        )
        self.assertEqual(resolved.search_budget, 30)  # kwargs win
        self.assertEqual(resolved.search_alpha, 0.7)  # then command line
        self.assertEqual(resolved.machine, "v100x4")  # then environment

    def test_unknown_kwarg_is_rejected(self):
        with self.assertRaisesRegex(TypeError, "search_budgett"):
            settings.resolve({"search_budgett": 3}, {}, {})

    def test_negative_budget_is_rejected(self):
        with self.assertRaisesRegex(ValueError, "search_budget=-1"):
            settings.resolve({"search_budget": -1}, {}, {})

    def test_bad_environment_value_names_variable(self):
        with self.assertRaisesRegex(ValueError, "FLEXFLOW_KERAS_SEARCH_BUDGET"):
            settings.resolve({}, {}, {"FLEXFLOW_KERAS_SEARCH_BUDGET": "x"})

    def test_export_path_is_checked_before_the_search(self):
        # Before, a missing folder failed only when the search had ended,
        # with a bare FileNotFoundError from `open`.
        with tempfile.TemporaryDirectory() as folder:
            missing = os.path.join(folder, "nope", "strategy.txt")
            with self.assertRaisesRegex(
                    ValueError, r"folder that does not exist .*nope"):
                settings.resolve({}, {"export_strategy": missing}, {})
            with self.assertRaisesRegex(ValueError, "not a folder"):
                settings.resolve({"export_strategy": folder}, {}, {})
            path = os.path.join(folder, "strategy.txt")
            self.assertEqual(
                settings.resolve({"export_strategy": path}, {}, {})
                .export_strategy, path)


if __name__ == "__main__":
    unittest.main()
