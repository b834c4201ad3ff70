"""Which tenant a request belongs to: the tenant whose API key it carries (``--tenant-config``'s
``api_keys``), else the value of ``--tenant-header`` when that flag names one, else ``default``.
A key's tenant wins over the header, so a key holder cannot spend another tenant's share.
Names in the header are checked (letters, digits, ``._:-``, at most 64); a router keeps state for
at most ``MAX_TENANTS`` names not listed in the config, so a header cannot grow it without bound."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pdserve.router.errors import bad_request
from pdserve.router.tenancy.tenant_config import DEFAULT_TENANT, TENANT_NAME, TenantTable

MAX_TENANTS = 1024


class TenantNamer:
    def __init__(self, table: TenantTable, header: str | None):
        self.table = table
        self.header = header.lower() if header else None
        self._seen: set[str] = set()

    def tenant(self, headers: Mapping[str, str], key_tenant: str | None) -> str:
        if key_tenant is not None:
            return key_tenant
        if self.header is None:
            return DEFAULT_TENANT
        raw = headers.get(self.header)
        if raw is None:
            return DEFAULT_TENANT
        name = raw.strip()
        if not TENANT_NAME.fullmatch(name):
            raise bad_request(f"header {self.header} must be 1-64 of letters, digits and '._:-', "
                              f"starting with a letter or digit, got {raw[:40]!r}", self.header)
        if name not in self.table.tenants and name not in self._seen:
            if len(self._seen) >= MAX_TENANTS:
                raise bad_request(f"header {self.header}: this router already serves {MAX_TENANTS} "
                                  "tenants not listed in --tenant-config", self.header)
            self._seen.add(name)
        return name


def key_tenant(authorization: str, owners: Mapping[str, str]) -> str | None:
    """The tenant whose API key ``authorization`` (``Bearer KEY``) carries, or None. Every key is
    compared, in constant time, so the answer's timing does not tell how much of a key matched."""
    if not owners or not authorization.startswith("Bearer "):
        return None
    given = authorization[7:].encode()
    found = None
    for key, tenant in owners.items():
        if hmac.compare_digest(given, key.encode()):
            found = tenant
    return found
