"""Build the gateway's config file from its ConfigMap and its Secret (the gateway pod's init container).

`hasten gateway` reads one YAML file. In Kubernetes its routing config lives in a ConfigMap
(deploy/k8s/base/gateway-configmap.yaml) and what must stay secret, the tenants' API keys and the
cache-salt HMAC key, in a Secret (gateway-secret.yaml). This script lays the Secret's top-level keys
over the ConfigMap's document, validates the result with hasten's own loader (every problem at once,
exit 2, so a bad config stops the pod before the gateway starts), and writes it, readable by its
owner only, where the gateway container reads it:

    python3 deploy/gateway/render_config.py --config /etc/hasten/config/gateway.yaml \\
        --secrets /etc/hasten/secrets/secrets.yaml --out /run/hasten/gateway.yaml --require-tenants

A key present in both that is a mapping on both sides (`cache_salt`) is merged one level deep; any
other key of the Secret replaces the ConfigMap's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

SECRET_KEYS = ("tenants", "cache_salt", "redis")  # what the Secret may set: keys, the salt key, a redis URL


class RenderError(ValueError):
    pass


def merge(config: dict[str, Any], secrets: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap's document with the Secret's keys laid over it."""
    unknown = sorted(set(secrets) - set(SECRET_KEYS))
    if unknown:
        raise RenderError(f"the secret may only set {', '.join(SECRET_KEYS)}; got {', '.join(unknown)}")
    out = dict(config)
    for key, value in secrets.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _load(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RenderError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise RenderError(f"the {what} {path} is not valid YAML: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise RenderError(f"the {what} {path} must be a mapping, got {type(doc).__name__}")
    return doc


def render(config_path: Path, secrets_path: Path | None, require_tenants: bool = False) -> tuple[str, Any]:
    """The merged YAML text and the GatewayConfig it parses to; raises RenderError or ConfigError."""
    from hasten.gateway.config import parse_config

    config = _load(config_path, "config")
    secrets = _load(secrets_path, "secret") if secrets_path is not None else {}
    merged = merge(config, secrets)
    parsed = parse_config(merged, f"{config_path} + {secrets_path}")
    if require_tenants and not parsed.tenants:
        raise RenderError("no tenants configured: the gateway would accept requests without an API key")
    return yaml.safe_dump(merged, sort_keys=False), parsed


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 (it holds API keys), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path, help="gateway.yaml from the ConfigMap")
    p.add_argument("--secrets", type=Path, help="YAML from the Secret (tenants, cache_salt, redis)")
    p.add_argument("--out", required=True, type=Path, help="where the gateway reads its config")
    p.add_argument("--require-tenants", action="store_true", help="fail unless at least one tenant is set")
    args = p.parse_args(argv)
    from hasten.gateway.config import ConfigError

    try:
        text, parsed = render(args.config, args.secrets, args.require_tenants)
    except (RenderError, ConfigError) as exc:
        print(f"render_config: {exc}", file=sys.stderr)
        return 2
    write_private(args.out, text)
    backends = sum(len(pool.backends) for pool in parsed.models)
    print(f"render_config: wrote {args.out}: {len(parsed.models)} model pool(s), {backends} backend(s), "
          f"{len(parsed.tenants)} tenant(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
