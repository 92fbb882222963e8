"""Model runners: one per backend, behind the small interface in :mod:`.base`."""
