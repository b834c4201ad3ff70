"""Model execution: configs, loading, the models, the runner of one step."""
