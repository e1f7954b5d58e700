"""The `sluice` console script, above every tier (see `sluice.cli`)."""
