"""Distributed layerwise offload: topology rules, bounded control collectives, the failure guard."""
