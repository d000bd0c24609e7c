"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=W`: the updates of one RL step on a fixed rollout
batch, split over the W ranks by whole groups, for several objectives, aggregations, replay modes and routing
variants. Rank 0 saves, per case, the global metrics of every update, the gradients of the first update (of the
first that gives a parameter one, for PR2's predictors) and the parameters after the step.

    torchrun --nproc_per_node=2 tests/dp_step.py OUT.pt

Every rank generates the same full batch from an unsharded copy of the initial weights with the same seed, then
keeps its share: rank r holds prompts [r·P/W, (r+1)·P/W), and its minibatch j the j-th of its prompts. With one
rank the minibatches are laid out as the union of the ranks' (`order` below), so both runs make the same updates.
"""

from __future__ import annotations

import sys
from dataclasses import fields, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

from algos import group_advantages  # noqa: E402
from experiments.ranks import Ranks  # noqa: E402
from experiments.run import launch  # noqa: E402
from experiments.step.batch import Rollout, collect_rollout, split_minibatches  # noqa: E402
from experiments.step.engines import (
    HFEngine,  # noqa: E402
    Sampling,  # noqa: E402
)
from experiments.step.trainer import RLTrainer  # noqa: E402
from models.policy import ModelConfig, build_policy  # noqa: E402
from tests.test_train import compose_train  # noqa: E402

PROMPTS, GROUP, MINIBATCHES = 4, 4, 2
CASES = {
    "grpo seq-mean-token-mean": ["algo=grpo"],
    "grpo token-mean": ["algo=grpo", "algo.loss_agg=token-mean"],
    "dr_grpo seq-mean-token-sum-norm": ["algo=dr_grpo"],
    "gspo": ["algo=gspo"],
    "grpo + r2": ["algo=grpo", "routing.replay=r2"],
    "gspo + r2": ["algo=gspo", "routing.replay=r2"],
    "grpo + load-balancing loss": ["algo=grpo", "routers=[aux_loss]", "routers.aux_loss.coef=0.05"],
    "grpo + r2 full replay": ["algo=grpo", "routing.replay=r2", "routing_variant=full_replay"],
    "gspo + r2 soft replay": [
        "algo=gspo",
        "routing.replay=r2",
        "routing_variant=soft_replay",
        "routing_variant.top_margin=null",
        "routing_variant.min_prob=0.2",
    ],
    "grpo + router shift": ["algo=grpo", "routing_variant=router_shift"],
    # the decomposition's extra forwards run between the backward and the optimizer step: on FSDP2 shards too
    "grpo + decomposition": ["algo=grpo", "routing.decompose_every=1"],
    "grpo + r2 + decomposition": ["algo=grpo", "routing.replay=r2", "routing.decompose_every=1"],
    # the predictors and their routers are FSDP2 units of their own, called outside the layers' forwards
    "grpo + pr2": ["algo=grpo", "routing.replay=r3", "routing_variant=predictive"],
}


def take_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout of a subset of its rows (tensors and lists indexed alike)."""
    values = {}
    for f in fields(rollout):
        value = getattr(rollout, f.name)
        if isinstance(value, torch.Tensor):
            values[f.name] = value[rows]
        elif isinstance(value, list):
            values[f.name] = [value[i] for i in rows.tolist()]
        elif f.name == "routes" and value is not None:
            values[f.name] = value.rows(rows)
    return replace(rollout, **values)


def run_case(overrides: list[str], ranks: Ranks) -> dict:
    cfg = compose_train(
        *overrides,
        f"trainer.prompts_per_step={PROMPTS}",
        f"trainer.group_size={GROUP}",
        f"trainer.minibatches={MINIBATCHES}",
        "trainer.minibatch_layout=groups",
        "trainer.lr=1e-3",
        "trainer.steps=1",
    )
    trainer = RLTrainer(cfg, ranks)
    unsharded, tokenizer = build_policy(ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True)))
    trainer.variant.start(unsharded)
    torch.manual_seed(123)
    examples = trainer.train_examples[:PROMPTS]
    sampling = Sampling(
        GROUP,
        cfg.trainer.max_new_tokens,
        cfg.trainer.temperature,
        record_routing=trainer.plan.engine_records_routing,
        predict_routes=trainer.plan.engine_predicts_routes,
    )
    full = collect_rollout(HFEngine(unsharded.eval(), tokenizer), trainer.task, examples, sampling)
    # A random model earns no reward on addition: fixed made-up rewards give every group an advantage to learn.
    full = replace(full, rewards=torch.rand(full.size, generator=torch.Generator().manual_seed(7)))
    share = PROMPTS // ranks.world
    mine = torch.arange(ranks.rank * share * GROUP, (ranks.rank + 1) * share * GROUP)
    rollout = take_rows(full, mine)
    advantages = group_advantages(rollout.rewards, GROUP, scale_by_std=trainer.advantage_std)
    per_minibatch = share // MINIBATCHES
    if ranks.world == 1:
        # The union of what each of 2 ranks would put in minibatch j: prompts j and 2 + j.
        prompt_order = torch.tensor([0, 2, 1, 3])
        order = (prompt_order[:, None] * GROUP + torch.arange(GROUP)).reshape(-1)
    else:
        order = torch.arange(rollout.size)
    assert per_minibatch >= 1
    minibatches = split_minibatches(rollout, advantages, order, MINIBATCHES, trainer.device)
    old = [trainer.old_policy(mb) for mb in minibatches]
    grads: dict[str, torch.Tensor] = {}
    optimizer_step = trainer._optimizer_step

    def first_grads(finite: bool, update) -> dict[str, float]:
        for name, param in trainer.model.named_parameters():
            # each parameter's gradient of the first update that gives it one: PR2's predictors', the second's
            if name not in grads and param.grad is not None:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                grads[name] = grad.detach().clone()
        return optimizer_step(finite, update)

    trainer._optimizer_step = first_grads
    metrics = [trainer.update(mb, old_policy) for mb, old_policy in zip(minibatches, old)]
    params = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {"metrics": metrics, "grads": grads, "params": {k: v.detach().clone() for k, v in params.items()}}


def main() -> None:
    torch.set_num_threads(1)
    ranks = launch.start("cpu")
    results = {name: run_case(overrides, ranks) for name, overrides in CASES.items()}
    if ranks.main:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
