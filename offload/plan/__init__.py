"""Pure planners (placement, codec) over one ring model, and the mechanisms that measure a step and apply a plan."""
