"""``--init-expert-location``: the MoE layers' starting placement, ``trivial`` or a JSON file.

The file is SGLang's expert-location format in JSON, one of:

- ``{"physical_to_logical_map": [[...], ...]}``: per decoder layer (all ``num_hidden_layers`` rows;
  the rows of layers without routed experts are not read), the logical expert each physical slot
  holds; a row has E + ``--ep-num-redundant-experts`` slots, ``E/ep_size``-style runs per EP rank
  (``layers/ep_placement.py``), and names every logical expert at least once.
- ``{"logical_count": [[...], ...]}``: per decoder layer, a per-expert token count (a
  ``/dump_expert_distribution_record`` result); the placement is EPLB's for that load
  (``layers/ep_rebalance.py``).

Anything else is a ValueError naming the file, the layer and what is wrong.
"""

from __future__ import annotations

import json

from pdserve.engine.model_executor.layers.ep_placement import (ExpertPlacement, check_physical_to_logical,
                                                                trivial_placement)
from pdserve.engine.model_executor.layers.ep_rebalance import rebalance_layer


def expert_locations(spec: str, num_layers: int, moe_layers: list[int], num_experts: int, num_redundant: int,
                     ep_size: int) -> dict[int, ExpertPlacement]:
    """Per MoE layer index, its starting placement from ``spec`` (``trivial`` or a JSON file's path)."""
    trivial = trivial_placement(num_experts, num_redundant, ep_size)
    if spec == "trivial":
        return {i: trivial for i in moe_layers}
    try:
        with open(spec) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"init_expert_location {spec!r}: cannot read it as JSON ({e})") from None
    keys = ("physical_to_logical_map", "logical_count")
    if not isinstance(data, dict) or sum(k in data for k in keys) != 1:
        raise ValueError(f"init_expert_location {spec!r}: must be an object with exactly one of {keys}")
    key = next(k for k in keys if k in data)
    rows = data[key]
    if not isinstance(rows, list) or len(rows) != num_layers or not all(isinstance(r, list) for r in rows):
        raise ValueError(f"init_expert_location {spec!r}: {key} must be a list of {num_layers} rows (one per "
                         f"decoder layer)")
    out = {}
    for i in moe_layers:
        row = rows[i]
        try:
            if key == "logical_count":
                if len(row) != num_experts or not all(isinstance(x, (int, float)) and x >= 0 for x in row):
                    raise ValueError(f"a row must be {num_experts} counts >= 0")
                out[i] = rebalance_layer(row, trivial)
                continue
            if len(row) != trivial.num_physical:
                raise ValueError(f"a row has {len(row)} slots; the model's {num_experts} experts plus "
                                 f"ep_num_redundant_experts {num_redundant} make {trivial.num_physical}")
            check_physical_to_logical(row, num_experts, ep_size)
            out[i] = ExpertPlacement(tuple(row), num_experts, ep_size)
        except ValueError as e:
            raise ValueError(f"init_expert_location {spec!r}: {key}, layer {i}: {e}") from None
    return out
