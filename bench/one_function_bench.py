"""Could a model's own step reach the whole space's plans as one DTensor
function over several meshes? (issue 22)

    python bench/one_function_bench.py [--budget 1000] [--seed 0]
        [--models alexnet,inception_v3,...]

A model that runs its own step (a `train_step` override, ...) is one
Python function, traced into one DTensor function. DTensor runs such a
function over several meshes when they all have the same number of
devices (docs/ARCHITECTURE.md, "Several meshes in one function"), and
moves a value between two meshes only through `copy_to_mesh`, which
copies replicated layouts, or sharded ones one to one: a value whose
split changes between meshes is relaid out to replicated, copied and
sliced (`taskgraph.replicated_pairs`). The whole space's plans move
values region by region instead, as the layer-by-layer executor does
(`runtime/moves.py`), between separate functions.

Per FlexFlow benchmark model (full size, on its paper machine, as in
`bench/own_step_bench.py`), simulated ms per step, every figure on the
planner's simulator (the optimizer's slots priced):

- data parallelism;
- the plain plan (`planner.make_plan`, the whole space, region moves);
- that plan with its moves between meshes priced as one DTensor
  function makes them (`Simulator(between_meshes="replicated")`);
- the own-step plan (`make_plan` of the `train_step` variant: one N-D
  mesh, `search.search_meshes`), as compile() reports it;
- the best plan on meshes that all have one size k (what DTensor runs
  in one function): for each k (all n devices, then each of
  `search_space.fewer_devices(n)`), a search with the same budget and
  seed on the "replicated" simulator over every op's configs
  (`mesh_space.mesh_configs`) on every mesh of k devices
  (`mesh_family`: each shape, over each block of k devices; for k = n
  the views of all the devices, from the own-step plan too); the best
  k's figure.

The last ratio is what the several-mesh route could give a model that
runs its own step, where the own-step ratio is what it gets today (the
issue's target: within 1.05). Moves between two configs that one mesh
of devices 0..k-1 holds are priced as the own-step plan's are; on a
mesh of other devices, moves between two different splits are priced
as between meshes (a gather either way).
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import own_step_bench  # noqa: E402  (device setup first)

from search_bench import CASES  # noqa: E402
from flexflow_keras import (  # noqa: E402
    planner, search, search_space, simulator,
)
from flexflow_keras.mesh_space import (  # noqa: E402
    MeshSpec, mesh_configs, mesh_shapes,
)
from flexflow_keras.optimizer_slots import optimizer_slots  # noqa: E402
from flexflow_keras.settings import Settings  # noqa: E402

def mesh_family(size: int, num_devices: int) -> list[MeshSpec]:
    """Every mesh of `size` devices that DTensor could run beside the
    others in one function: each shape of `size` (`mesh_shapes`) over
    each block of devices `g*size..(g+1)*size-1`; for `size` equal to
    `num_devices`, the views of all the devices."""
    return [
        MeshSpec(shape, tuple(range(g * size, (g + 1) * size)))
        for g in range(num_devices // size)
        for shape in mesh_shapes(size)
    ]


def family_choices(graph, meshes: list[MeshSpec]) -> dict:
    """Per op, its configs on each of `meshes` (`mesh_configs`), each
    once, in the meshes' order."""
    choices = {}
    for op in graph.ops:
        configs = {}
        for mesh in meshes:
            configs.update(dict.fromkeys(mesh_configs(op, mesh)))
        choices[op.name] = list(configs)
    return choices


def run_case(name: str, budget: int, seed: int) -> dict:
    example, machine_name, batch = CASES[name]
    settings = Settings(search_budget=budget, search_seed=seed,
                        machine=machine_name)
    models = own_step_bench._variants(example)
    plain = planner.make_plan(models["plain"], batch, settings, verbose=0)
    own = planner.make_plan(
        models["train_step"], batch, settings, verbose=0,
        one_mesh_reason=own_step_bench._reason(models["train_step"]),
    )
    graph, machine = plain.graph, plain.machine
    one_function = simulator.Simulator(
        graph, machine, optimizer_slots=optimizer_slots(None),
        between_meshes="replicated",
    )
    start = time.perf_counter()
    n = machine.num_devices
    families = []  # (best ms, mesh size) per size of the meshes
    for size in [n, *search_space.fewer_devices(n)]:
        found = search.search(
            graph, one_function, n, budget, seed=seed, verbose=0,
            choices=family_choices(graph, mesh_family(size, n)),
            candidates=(own.strategy,) if size == n else (),
        )
        families.append((found.best_ms, size))
    several = min(families)
    return {
        "model": name, "machine": machine_name,
        "dp": plain.search_result.data_parallel_ms,
        "plain": plain.step_ms,
        "plain_one_function": one_function.simulate(plain.strategy).step_ms,
        "own": own.step_ms,
        "several": several[0],
        "size": several[1],
        "searches_s": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    args = own_step_bench.parsed_arguments(__doc__.split("\n")[0], argv)
    print("| model | machine | data parallel | plain plan | plain plan as "
          "one function | own-step plan (one mesh) | best on meshes of one "
          "size as one function (size) | own / plain | several / plain "
          "| searches s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        r = run_case(name, args.budget, args.seed)
        print(
            f"| {name} | {r['machine']} | {r['dp']:.2f} | {r['plain']:.2f} "
            f"| {r['plain_one_function']:.2f} | {r['own']:.2f} "
            f"| {r['several']:.2f} ({r['size']}) "
            f"| {r['own'] / r['plain']:.3f} "
            f"| {r['several'] / r['plain']:.3f} | {r['searches_s']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
