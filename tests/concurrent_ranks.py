"""Run by tests/test_concurrent.py and tests/test_ray.py under `torchrun --nproc_per_node=2`: a concurrent run
(`rollout.source=concurrent`, the overrides after OUT) on two FSDP2 ranks, rank 0 driving the workers. Each rank saves
to OUT/rank{r}.pt, per step, the prompts of the rows it trained and their version stamps, and how far their μ_old is
from the log-probs of the full weights of the version they are stamped with (gathered from both ranks' shards when it
was published) and of the next version: the weights rank 0 published are the ones that sampled.

    torchrun --nproc_per_node=2 tests/concurrent_ranks.py OUT OVERRIDE...
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.step.engines import full_weights  # noqa: E402
from experiments.step.sources.workers import Concurrent  # noqa: E402
from experiments.step.trainer import RLTrainer  # noqa: E402
from experiments.train import train  # noqa: E402
from models.policy import ModelConfig, build_policy  # noqa: E402
from tests.test_concurrent import mu_old_under  # noqa: E402
from tests.test_train import compose_train  # noqa: E402


def main(out: Path, overrides: list[str]) -> None:
    versions: dict[int, dict[str, torch.Tensor]] = {}
    served: dict[int, object] = {}
    steps: list[dict] = []
    found: dict = {}
    real_init, real_publish, real_take = RLTrainer.__init__, RLTrainer.publish, Concurrent.take

    def init(trainer, *args, **kwargs):
        real_init(trainer, *args, **kwargs)
        found["trainer"] = trainer
        versions[0] = copy.deepcopy(full_weights(trainer.model))  # every rank: a gather of the shards

    def take(source, step, seed):
        served[step] = share = real_take(source, step, seed)
        return share

    def publish(trainer):
        step = trainer.step_index
        versions[step] = copy.deepcopy(full_weights(trainer.model))
        share = served[step]
        (version,) = set(share.versions.tolist())
        # a plain copy to score with: the trainer's own is sharded
        unsharded, _ = build_policy(ModelConfig(**OmegaConf.to_container(trainer.cfg.model, resolve=True)))
        trainer_model = trainer.model
        trainer.model = unsharded
        try:
            gaps = [float(mu_old_under(trainer, share.rollout, versions[v]).max()) for v in (version, version + 1)]
        finally:
            trainer.model = trainer_model
        steps.append(
            {
                "step": step,
                "prompts": [example.prompt for example in share.rollout.examples],
                "versions": share.versions.tolist(),
                "gap_own": gaps[0],
                "gap_next": gaps[1],
            }
        )
        real_publish(trainer)

    RLTrainer.__init__, RLTrainer.publish, Concurrent.take = init, publish, take
    summary = train(compose_train(*overrides), out / "run")
    rank = found["trainer"].ranks.rank
    torch.save({"steps": steps, "summary": summary}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
