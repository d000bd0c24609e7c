"""Router switches, each on or off by name (`routers=[...]`, `build_router_switches`, `ROUTER_SWITCHES`); see `base`
for the contract (the load-balancing losses: `algos.routers.balancing`)."""

# Importing a module registers its switch.
from algos.routers import aux_loss, bias_update, freeze, lagged_replay  # noqa: F401
from algos.routers.base import ROUTER_SWITCHES, RouterSwitch, RunFacts, build_router_switches

__all__ = ["ROUTER_SWITCHES", "RouterSwitch", "RunFacts", "build_router_switches"]
