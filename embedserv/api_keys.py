"""Named API keys: each is a tenant, with a default priority and a share of the admission limit. No torch.

`--api-key KEY` is one key named "default". Several keys come from `--api-keys-file FILE` (a YAML list, fit
for a mounted Kubernetes Secret) or the config file's `server: api_keys:` list, each entry
`{name, key, priority, max_share}`. A call's key decides its tenant (call_class.CallClass.tenant), the
priority of its calls that name none, and how many of --max-concurrent-requests' inputs its calls may hold at once:
`max_share` of them (default: all with one key, half with several), so one tenant's burst cannot take every slot.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from embedserv.errors import ConfigError

# With several keys, a key without max_share may hold this share of the admission limit.
DEFAULT_SHARE_OF_MANY = 0.5
_FIELDS = ("name", "key", "priority", "max_share")


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = field(repr=False)
    # The priority of its calls that name none (None: the model's --default-priority).
    priority: int | None = None
    # The share of --max-concurrent-requests its calls may hold at once (None: see the module's docstring).
    max_share: float | None = None


def api_keys_of(entries: object, where: str) -> tuple[ApiKey, ...]:
    """A YAML list of `{name, key, priority, max_share}` mappings as checked ApiKeys."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: api_keys must be a non-empty list of {{name, key, priority, max_share}}")
    keys = []
    for index, entry in enumerate(entries):
        place = f"{where}: api_keys[{index}]"
        if not isinstance(entry, dict) or set(entry) - set(_FIELDS) or not {"name", "key"} <= set(entry):
            raise ConfigError(f"{place} must be a mapping with name and key (and optionally priority, max_share)")
        name, key, priority, share = (entry.get(f) for f in _FIELDS)
        if not isinstance(name, str) or not name.strip() or not isinstance(key, str) or not key.strip():
            raise ConfigError(f"{place}: name and key must be non-empty strings")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ConfigError(f"{place}: priority must be an integer, not {priority!r}")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ConfigError(f"{place}: max_share must be a number in (0, 1], not {share!r}")
        keys.append(ApiKey(name.strip(), key.strip(), priority, None if share is None else float(share)))
    check_unique(keys, where)
    return tuple(keys)


def read_api_keys_file(path: str) -> tuple[ApiKey, ...]:
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--api-keys-file {path}: cannot read it: {exc}") from None
    return api_keys_of(entries, f"--api-keys-file {path}")


def check_unique(keys: list[ApiKey] | tuple[ApiKey, ...], where: str) -> None:
    for attribute in ("name", "key"):
        values = [getattr(k, attribute) for k in keys]
        if len(set(values)) != len(values):
            repeated = sorted({v for v in values if values.count(v) > 1}) if attribute == "name" else ["(hidden)"]
            raise ConfigError(f"{where}: every API key needs its own {attribute}; repeated: {', '.join(repeated)}")


class KeyTable:
    """The server's keys, for the gRPC interceptor and the HTTP edge, and each key's cap on inputs in flight."""

    def __init__(self, keys: tuple[ApiKey, ...], limit: int) -> None:
        self.keys = keys
        self._encoded = [(k.key.encode(), k) for k in keys]
        default = 1.0 if len(keys) == 1 else DEFAULT_SHARE_OF_MANY
        self.caps = {k.name: max(1, int(limit * (k.max_share if k.max_share is not None else default))) for k in keys}

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, authorization: str | None, carrier: str) -> tuple[ApiKey | None, str | None]:
        """(the key an `authorization` value carries, None) or (None, what is wrong with it)."""
        if authorization is None:
            return None, f"this server needs an API key: send {carrier} 'authorization: Bearer <key>'"
        scheme, _, given = str(authorization).partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None, f"the authorization {carrier} must read 'Bearer <key>'"
        encoded = given.strip().encode()
        # Every key is compared (constant time each), so the time taken tells nothing of which one matched.
        found = [key for secret, key in self._encoded if hmac.compare_digest(encoded, secret)]
        if not found:
            which = "the key" if len(self.keys) == 1 else "one of the keys"
            return None, f"the API key is wrong; send {which} the server was started with"
        return found[0], None
