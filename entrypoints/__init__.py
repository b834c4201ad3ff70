"""Entry points: the CLI, the engine server, the cluster launcher, process groups, the server config."""
