"""pdserve.prefill."""
