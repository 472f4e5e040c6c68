"""The package's imports flow one way: no cycle, and the planning stages
(graph, costs, simulator, search, planner) import nothing of the stages
after them (the runtime, the Keras models, the command lines).

Read from the source with `ast`, lazy imports inside functions
included: a cycle hidden in a function is still a cycle.
"""

import ast
import os
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "flexflow_keras"

# The planning core: pure computation over `OpGraph`s. It imports no
# Keras, no TensorFlow and not the bridge from Keras (`keras_graph`), not
# even lazily; op costs are measured in cost.py, devices read in
# machine.py.
PURE = tuple(f"{PACKAGE}.{name}" for name in (
    "graph", "strategy", "search_space", "taskgraph", "schedule",
    "simulator", "search", "report", "reference", "experts", "partition",
    "mesh_space",
    "optimizer_slots",
))
OUTSIDE_PURE = ("keras", "tensorflow", f"{PACKAGE}.keras_graph")

# Modules of the stages after planning; nothing outside them imports them.
LATER = ("flexflow_keras.runtime", "flexflow_keras.models",
         "flexflow_keras.launch", "flexflow_keras.__main__")


def modules() -> dict[str, str]:
    """Module name -> file path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            found[name.removesuffix(".__init__")] = path
    return found


def imports(found: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the package root
    aside: importing any submodule runs it first anyway)."""
    edges = {}
    for name, path in found.items():
        package = name if path.endswith("__init__.py") else (
            name.rsplit(".", 1)[0]
        )
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split("."))
                                                - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in found else base)
        edges[name] = {t for t in targets
                       if t in found and t not in (name, PACKAGE)}
    return edges


def all_imports(path: str) -> set[str]:
    """Every absolute module name a file imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _later(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in LATER)


class ImportGraphTest(unittest.TestCase):
    def setUp(self):
        self.edges = imports(modules())

    def test_walker_sees_the_package(self):
        self.assertIn("flexflow_keras.report",
                      self.edges["flexflow_keras.search"])
        self.assertIn("flexflow_keras.graph",
                      self.edges["flexflow_keras.cost"])
        self.assertIn("flexflow_keras.runtime.clients",
                      self.edges["flexflow_keras.runtime.trainer"])
        # A made-up cycle is found.
        self.assertEqual(cycles({"a": {"b"}, "b": {"a"}, "c": set()}),
                         [["a", "b"]])

    def test_no_cycles(self):
        self.assertEqual(cycles(self.edges), [])

    def test_planning_imports_no_later_stage(self):
        backward = {
            name: sorted(t for t in targets if _later(t))
            for name, targets in self.edges.items()
            if not _later(name) and name != PACKAGE
        }
        self.assertEqual({k: v for k, v in backward.items() if v}, {})

    def test_planning_core_imports_no_keras(self):
        found = modules()
        for name in PURE:
            reached = {
                target for target in all_imports(found[name])
                if any(target == o or target.startswith(o + ".")
                       for o in OUTSIDE_PURE)
            }
            self.assertEqual(reached, set(), name)
        # The check sees a Keras import where there is one.
        self.assertIn("keras.tree",
                      all_imports(found[f"{PACKAGE}.keras_graph"]))

    def test_runtime_does_not_import_the_models(self):
        for name, targets in self.edges.items():
            if name.startswith("flexflow_keras.runtime"):
                self.assertNotIn("flexflow_keras.models", targets, name)


if __name__ == "__main__":
    unittest.main()
