"""The tiers under the arena and across restarts, measured: device tiers, disk, L2, restart."""
