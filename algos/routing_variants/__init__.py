"""Routing variants, interchangeable by name (`build_routing_variant`, `ROUTING_VARIANTS`); see `base` for the
contract."""

# Importing a module registers its variant.
from algos.routing_variants import full_replay, predictive, router_shift, soft_replay  # noqa: F401
from algos.routing_variants.base import ROUTING_VARIANTS, RoutingVariant, VariantNeeds, build_routing_variant

__all__ = ["ROUTING_VARIANTS", "RoutingVariant", "VariantNeeds", "build_routing_variant"]
