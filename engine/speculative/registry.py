"""The proposers by ``--speculative-algorithm`` name, each built by a factory ``(config, runner)``.

A proposer's module is imported only when it is chosen (``STANDALONE`` loads a draft model and its
module imports the model executor, as ``NEXTN``'s, which loads the checkpoint's MTP layer; ``NGRAM``
is pure Python). The names are
``speculative_names.SPECULATIVE_ALGORITHMS``, which the config and the CLI check.
"""

from __future__ import annotations

import importlib

from pdserve.engine.speculative.proposer import Proposer
from pdserve.engine.speculative_names import NEXTN, NGRAM, SPECULATIVE_ALGORITHMS, STANDALONE

# name -> "module:factory"; the factory takes (config: EngineConfig, target_runner)
PROPOSERS: dict[str, str] = {
    NGRAM: "pdserve.engine.speculative.ngram:NgramProposer.from_config",
    STANDALONE: "pdserve.engine.speculative.self_draft:standalone_proposer",
    NEXTN: "pdserve.engine.speculative.nextn:nextn_proposer",
}


def create_proposer(config, runner) -> Proposer:
    """Import and build the proposer ``config.speculative_algorithm`` names; a proposer whose module
    is missing from this build stops the start with a message naming the flag."""
    name = config.speculative_algorithm
    if name not in PROPOSERS:
        raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {name!r}")
    module_name, attr = PROPOSERS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(f"--speculative-algorithm {name} is not available in this build ({module_name} is missing)") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory(config, runner)
