"""Which sandboxes exist and with what settings: profiles, the operator's catalog, the warm pool, the reaper."""
