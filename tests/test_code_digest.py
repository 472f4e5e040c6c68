"""`code_digest.class_digest`: the same code gives the same digest, in
this process and in another; an edit of what the class runs gives
another one (the probe's cache keys on it: `runtime/probe.py`)."""

import os
import subprocess
import sys
import textwrap
import unittest

from flexflow_keras import code_digest

LAYER = textwrap.dedent('''
    import keras

    def helper(x):
        return x * 2.0

    class Edited(keras.layers.Layer):
        def call(self, x):
            def inner(y):
                return y + 1.0
            if self.name in {"alpha", "beta", "gamma"}:
                return x
            return inner(helper(x))
''')


def defined_in_a_script(source, name="Edited"):
    """The class `name` that `source` defines, run as a module of its own
    named like a user's script (as an edited script defines it again)."""
    scope = {"__name__": "user_script"}
    exec(compile(source, "user_script.py", "exec"), scope)
    return scope[name]


def digest_of(source):
    """The digest of `Edited` defined by `source` in a user's script."""
    return code_digest.class_digest(defined_in_a_script(source))


class ClassDigestTest(unittest.TestCase):
    def test_same_code_same_digest(self):
        self.assertEqual(digest_of(LAYER), digest_of(LAYER))

    def test_lines_added_above_do_not_count(self):
        self.assertEqual(digest_of("\n\n# a comment\n" + LAYER),
                         digest_of(LAYER))

    def test_edits_of_what_the_call_runs_count(self):
        edits = {
            "the method": ("return inner(helper(x))",
                           "return inner(helper(x)) * 3.0"),
            "a nested function": ("return y + 1.0", "return y - 1.0"),
            "a module function it calls": ("return x * 2.0",
                                           "return x * 4.0"),
        }
        for where, (old, new) in edits.items():
            with self.subTest(where=where):
                self.assertIn(old, LAYER)
                self.assertNotEqual(digest_of(LAYER.replace(old, new)),
                                    digest_of(LAYER))

    def test_keras_layers_have_none(self):
        import keras

        self.assertIsNone(code_digest.class_digest(keras.layers.Dense))
        self.assertIsNotNone(digest_of(LAYER))

    def test_same_digest_in_another_process(self):
        # A set of strings in the code (`in {...}`) is a constant whose
        # order follows the process's string hashing.
        here = os.path.dirname(os.path.abspath(__file__))
        script = (f"import sys; sys.path.insert(0, {here!r}); "
                  "import test_code_digest as t; "
                  "print(t.digest_of(t.LAYER))")
        digests = set()
        for seed in ("1", "2"):
            env = dict(os.environ, PYTHONHASHSEED=seed)
            digests.add(subprocess.run(
                [sys.executable, "-c", script], env=env, check=True,
                capture_output=True, text=True).stdout.strip())
        self.assertEqual(digests, {digest_of(LAYER)})


if __name__ == "__main__":
    unittest.main()
