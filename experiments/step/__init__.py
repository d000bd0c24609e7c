"""One RL step: the trainer, the scoring of a minibatch, the rollout engines, and what is decided before the first
step (docs/architecture.md)."""
