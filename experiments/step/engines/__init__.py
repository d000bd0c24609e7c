"""The rollout engines: what samples the completions of an RL step (mu_old), behind one interface."""
