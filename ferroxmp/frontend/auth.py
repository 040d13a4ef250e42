"""Keyring: who may call the server, and which tenant each key belongs to.

Keys come from `--api-key` (one key, no tenant) or `--api-key-file` (one key a line,
optionally `tenant:key`; blank lines and `#` comments skipped). A bare key in the
file is its own tenant, named by a digest of the key (never the key itself).

Invariants: the scheme is `Bearer` in any case (RFC 7235: schemes are
case-insensitive); a key is compared in constant time against every key, by
SHA-256 digest so neither a key's length nor its position in the file shows in the
timing; a tenant's name never holds ':' (so `tenant:salt` is unambiguous); the
same key twice in the file is refused at startup.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Optional

from ferroxmp.frontend.errors import ApiError

_TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
MAX_KEY_CHARS = 4096


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass
class Keyring:
    keys: list[tuple[bytes, str]] = field(default_factory=list)  # (sha256 of the key, tenant; "" = none)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def tenants(self) -> bool:
        """Keys came from a key file: every request is salted with its tenant."""
        return any(t for _, t in self.keys)

    @classmethod
    def from_args(cls, args: dict) -> "Keyring":
        if args.get("api_key_file"):
            with open(args["api_key_file"], encoding="utf-8") as f:
                return cls.parse(f.read(), args["api_key_file"])
        return cls([(_digest(args["api_key"]), "")] if args.get("api_key") else [])

    @classmethod
    def parse(cls, text: str, source: str = "the key file") -> "Keyring":
        ring = cls()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, key = line.partition(":")
            if not sep:
                tenant, key = "#" + hashlib.sha256(line.encode()).hexdigest()[:16], line
            elif not _TENANT.match(tenant):
                raise ValueError(f"{source}:{n}: tenant names are 1-64 of A-Z a-z 0-9 _ . @ -")
            if not key or len(key) > MAX_KEY_CHARS or any(c.isspace() for c in key):
                raise ValueError(f"{source}:{n}: a key is 1-{MAX_KEY_CHARS} characters without spaces")
            if any(hmac.compare_digest(d, _digest(key)) for d, _ in ring.keys):
                raise ValueError(f"{source}:{n}: this key is already on an earlier line")
            ring.keys.append((_digest(key), tenant))
        if not ring.keys:
            raise ValueError(f"{source} holds no key")
        return ring

    def check(self, authorization: str) -> Optional[str]:
        """The caller's tenant ("" without tenants), or a 401."""
        scheme, _, given = authorization.strip().partition(" ")
        digest = _digest(given.strip()) if scheme.lower() == "bearer" else b""
        found: Optional[str] = None
        for key, tenant in self.keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(key, digest) and found is None:
                found = tenant
        if found is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return found


def cache_salt(tenant: str, client_salt: str) -> str:
    """Prefixes are shared only under the same salt: a tenant's own, then the client's."""
    if not tenant:
        return client_salt
    return f"{tenant}:{client_salt}" if client_salt else tenant
