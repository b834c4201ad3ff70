"""Scheduling: requests, the scheduler and its loop, the scheduler rank process."""
