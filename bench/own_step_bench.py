"""What running its own step costs a model's plan (issue 22).

    python bench/own_step_bench.py [--budget 1000] [--seed 0]
        [--models alexnet,inception_v3,...]

Per FlexFlow benchmark model (full size, on its paper machine, as in
`bench/search_bench.py`), the simulated step time (ms) of:

- data parallelism;
- the plan of the model as written (`planner.make_plan`, the whole SOAP
  space: it runs Keras's default step);
- the plan of the same model with an L2 `kernel_regularizer` on every
  layer that has one: Keras's default step counts the penalty, as the
  layer-by-layer executor does (`step.Executor._penalty`), so it is
  searched in the whole space (before 2026-11-26 it ran its own step);
- the plan of the model whose class overrides `train_step`: it runs its
  own step (`runtime.own_step_reasons`), so `make_plan` searches it on
  one N-D mesh (`search.search_meshes`);

with the own-step plans' ratio to the plain plan (the issue's target:
within 1.05) and the mesh shape they chose. Every plan is made by
`planner.make_plan`, the function `compile()` calls, with the same
budget and seed; the three models have the same operator graph.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import flexflow_keras  # noqa: E402,F401  (device setup first)
import keras  # noqa: E402
import model_zoo  # noqa: E402

from search_bench import CASES  # noqa: E402
from flexflow_keras import planner, runtime  # noqa: E402
from flexflow_keras.mesh_space import MeshSpec  # noqa: E402
from flexflow_keras.settings import Settings  # noqa: E402

DEFAULT_MODELS = ("alexnet", "inception_v3", "rnntc", "rnnlm", "nmt_k80",
                  "dlrm", "transformer")


class _OwnStep(keras.Model):
    """A functional model whose class overrides `train_step`."""

    def train_step(self, data):
        return super().train_step(data)


def _with_l2(model: keras.Model) -> keras.Model:
    """`model` rebuilt with an L2 kernel regularizer on every layer that
    takes one."""
    config = model.get_config()
    for layer in config["layers"]:
        if "kernel_regularizer" in layer["config"]:
            layer["config"]["kernel_regularizer"] = {
                "class_name": "L2", "config": {"l2": 1e-4},
            }
    return keras.Model.from_config(config)


def _variants(example: str) -> dict[str, keras.Model]:
    keras.backend.clear_session()
    with model_zoo.without_weight_values():
        plain = model_zoo.load_example(example).build_model(small=False)
        plain = keras.Model(plain.inputs, plain.outputs, name=plain.name)
        l2 = _with_l2(plain)
        stepped = _OwnStep(plain.inputs, plain.outputs, name=plain.name)
    return {"plain": plain, "l2": l2, "train_step": stepped}


def _reason(model: keras.Model) -> str | None:
    reasons = [r for r in runtime.own_step_reasons(model)
               if "without a loss" not in r]  # none is compiled here
    return "; ".join(reasons) or None


def run_case(name: str, budget: int, seed: int) -> dict:
    example, machine_name, batch = CASES[name]
    settings = Settings(search_budget=budget, search_seed=seed,
                        machine=machine_name)
    row = {"model": name, "machine": machine_name}
    for kind, model in _variants(example).items():
        reason = _reason(model)
        if (kind == "train_step") != (reason is not None):
            raise AssertionError(f"{name} {kind}: own-step reason {reason}")
        start = time.perf_counter()
        plan = planner.make_plan(model, batch, settings, verbose=0,
                                 one_mesh_reason=reason)
        row[f"{kind}_s"] = time.perf_counter() - start
        row[kind] = plan.step_ms
        if kind == "plain":
            # On the planner's simulator (the optimizer's slots priced).
            row["dp"] = plan.search_result.data_parallel_ms
        else:
            mesh = MeshSpec.of(plan.strategy, plan.machine.num_devices)
            row[f"{kind}_mesh"] = ("several meshes" if mesh is None
                                   else "x".join(map(str, mesh.shape)))
    return row


def parsed_arguments(description: str, argv=None) -> argparse.Namespace:
    """`--budget`, `--seed` and `--models` (this bench's and
    `one_function_bench.py`'s), the budget and seed printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--budget", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    args = parser.parse_args(argv)
    print(f"budget {args.budget}, seed {args.seed}; simulated ms per step")
    return args


def main(argv=None) -> int:
    args = parsed_arguments(__doc__.split("\n")[0], argv)
    print("| model | machine | data parallel | plain plan | L2 plan (mesh) "
          "| train_step plan (mesh) | L2 / plain | train_step / plain "
          "| search s (plain, L2, train_step) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        r = run_case(name, args.budget, args.seed)
        print(
            f"| {name} | {r['machine']} | {r['dp']:.2f} | {r['plain']:.2f} "
            f"| {r['l2']:.2f} ({r['l2_mesh']}) "
            f"| {r['train_step']:.2f} ({r['train_step_mesh']}) "
            f"| {r['l2'] / r['plain']:.3f} "
            f"| {r['train_step'] / r['plain']:.3f} "
            f"| {r['plain_s']:.1f}, {r['l2_s']:.1f}, "
            f"{r['train_step_s']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
