"""The general node: one per DC, aggregating gradients over the WAN along the scheduler's trees."""
