"""pdserve.engine: the engine of one server process (configs, models, the scheduler, the front end).

``Engine`` (the offline API) lives with the other entry points (``pdserve.entrypoints.engine``);
``from pdserve.engine import Engine`` is its public name, resolved lazily so that processes which
only need the config or message types do not pay for torch and the model code. This alias (and
``python -m pdserve.engine``, which is ``pdserve serve``) are the engine folder's only imports
of the entry points above it (tests/structure/test_levels.py ``PUBLIC_ALIASES``).
"""


def __getattr__(name):
    if name == "Engine":
        from pdserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")


__all__ = ["Engine"]
