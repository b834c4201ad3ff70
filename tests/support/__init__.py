"""Helpers shared by more than one test folder: process stands (PD servers, stand-in router workers,
network namespaces), tiny checkpoints, scheduler-loop stands and parsers of the servers' outputs.
Test modules import them as ``support.<module>``: the test tree's root is on ``sys.path``."""
