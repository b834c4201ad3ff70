"""Scheduling: requests, the page pool, the radix cache, the scheduler and its loop."""
