"""Policy-optimisation objectives for RL of MoE language models, interchangeable by name.

`build_objective("gspo", clip_low=3e-4)` makes one; `OBJECTIVES` lists them. Each module registers its
objective on import (`@OBJECTIVES.register`), so a new objective is one module imported here, one yaml in
`conf/algo/` and one test.
"""

# Importing a module registers its objective.
from algos import cispo, dapo, dr_grpo, gmpo, grpo, gspo, gspo_token, minirl, sapo  # noqa: F401
from algos.advantages import group_advantages, zero_std_group_frac
from algos.objective import OBJECTIVES, Objective, ObjectiveOutput, build_objective

__all__ = ["OBJECTIVES", "Objective", "ObjectiveOutput", "build_objective", "group_advantages", "zero_std_group_frac"]
