"""The run around the steps: its directory, its log, checkpoints, ranks and torchrun, sweeps, CPU threads."""
