"""pdserve.decode."""
