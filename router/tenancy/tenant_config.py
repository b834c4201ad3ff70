"""``--tenant-config FILE``: each tenant's weight, limits and API keys, JSON or YAML.

    default:                    # tenants not listed (a header's name, no key): these settings
      weight: 1
    tenants:
      chat:
        weight: 4               # share of the queue against the others (deficit round-robin)
        requests_per_second: 20 # token bucket on requests; burst: requests_burst (default: the rate)
        tokens_per_second: 50000  # on prompt + max tokens; burst: tokens_burst (default: the rate)
        max_concurrent: 16      # requests holding a slot at once
        api_keys: [sk-chat-1]   # a request with this key is this tenant's

Every field is optional (no limit where absent). A bad file fails the router's start with a
message naming the tenant and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(frozen=True)
class TenantSpec:
    weight: float = 1.0
    requests_per_second: float | None = None
    requests_burst: float | None = None
    tokens_per_second: float | None = None
    tokens_burst: float | None = None
    max_concurrent: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        for name in ("requests_per_second", "requests_burst", "tokens_per_second", "tokens_burst"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")

    @property
    def request_capacity(self) -> float | None:
        rate = self.requests_per_second
        return None if rate is None else self.requests_burst or max(1.0, rate)

    @property
    def token_capacity(self) -> float | None:
        rate = self.tokens_per_second
        return None if rate is None else self.tokens_burst or max(1.0, rate)


@dataclass(frozen=True)
class TenantTable:
    default: TenantSpec = TenantSpec()
    tenants: dict[str, TenantSpec] = field(default_factory=dict)

    def spec(self, tenant: str) -> TenantSpec:
        return self.tenants.get(tenant, self.default)

    def key_owners(self) -> dict[str, str]:
        """API key -> tenant."""
        return {key: name for name, spec in self.tenants.items() for key in spec.api_keys}


_SPEC_FIELDS = {f.name for f in fields(TenantSpec)}


def _spec(where: str, raw: object) -> TenantSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of settings")
    unknown = sorted(set(raw) - _SPEC_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {sorted(_SPEC_FIELDS)})")
    keys = raw.get("api_keys", ())
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{where}.api_keys must be a list of non-empty strings")
    try:
        return TenantSpec(**{**raw, "api_keys": tuple(keys)})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def parse_tenant_table(raw: object) -> TenantTable:
    if not isinstance(raw, dict) or set(raw) - {"default", "tenants"}:
        raise ValueError("a tenant config is a mapping with 'default' and 'tenants'")
    default = _spec("default", raw.get("default") or {})
    if default.api_keys:
        raise ValueError("default.api_keys: keys name a tenant; list them under that tenant")
    tenants = {}
    owners: dict[str, str] = {}
    for name, spec_raw in (raw.get("tenants") or {}).items():
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise ValueError(f"tenant name {name!r} must match {TENANT_NAME.pattern}")
        spec = _spec(f"tenants.{name}", spec_raw)
        for key in spec.api_keys:
            if key in owners:
                raise ValueError(f"tenants.{name}.api_keys: a key is listed under {owners[key]!r} too")
            owners[key] = name
        tenants[name] = spec
    return TenantTable(default, tenants)


def load_tenant_table(path: str | None) -> TenantTable:
    """The table in ``path`` (``.json``: JSON, else YAML); every tenant alike without one."""
    if path is None:
        return TenantTable()
    text = Path(path).read_text()
    try:
        raw = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--tenant-config {path}: not valid JSON/YAML: {e}") from None
    try:
        return parse_tenant_table(raw)
    except ValueError as e:
        raise ValueError(f"--tenant-config {path}: {e}") from None
