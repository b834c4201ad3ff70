"""pdserve.engine."""
