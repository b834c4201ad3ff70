"""pdserve.engine.

``Engine`` (the offline API) is imported lazily, so that processes which only
need the config or message types do not pay for torch and the model code.
"""


def __getattr__(name):
    if name == "Engine":
        from pdserve.engine.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")


__all__ = ["Engine"]
