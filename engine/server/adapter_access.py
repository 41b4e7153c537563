"""Who may call a replica's adapter endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter), and from
where an adapter may be loaded.

A load reads a directory (or downloads an S3 prefix with the replica's credentials) that the caller names, so
these endpoints are admin endpoints:

- **Token.** With `$KVGATE_ENGINE_ADMIN_TOKEN` set, both need `Authorization: Bearer <token>` (compared in
  constant time); anything else is a 401. The token comes only from the environment: a command-line value
  would show in `ps`.
- **Secure by default.** Without a token they stay open only on a loopback address (the single box, where
  `kvgate up` starts its replicas); an engine listening beyond loopback refuses them with a 403 that says how
  to turn them on, unless `--insecure-open-adapters` opens them (said as a WARNING at start).
- **Roots.** `lora_path` must lie under an `--adapter-root` (a directory, after resolving symlinks and `..`, or
  an `s3://bucket/prefix`), or be a built-in (`builtin:NAME`), or be a source the engine was started with
  (`--adapter NAME=SOURCE`). Anything else is a 403 that says nothing of whether the path exists. A local
  source is loaded from its resolved path, so a symlink swapped after the check cannot lead outside.

The checks are pure functions over `AdapterAccess`; the path resolution (the one I/O) is passed in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.openai_wire import ApiError, is_loopback_host, require_bearer

ADMIN_TOKEN_ENV = "KVGATE_ENGINE_ADMIN_TOKEN"
INSECURE_FLAG = "--insecure-open-adapters"
S3_SCHEME = "s3://"
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class AdapterAccess:
    """The adapter endpoints' policy of one replica. The default refuses every call: a server built without
    one (a script, a test) opens nothing by accident."""

    token: str | None = field(default=None, repr=False)  # when set, the endpoints need it as a Bearer token
    open_without_token: bool = False  # without a token: True on loopback or with --insecure-open-adapters
    # Resolved absolute directories and normalized s3://bucket/prefix strings (see adapter_root) that
    # lora_path may lie under.
    roots: tuple[str, ...] = ()
    startup_sources: frozenset[str] = frozenset()  # --adapter sources: loadable again after an unload


def adapter_root(text: str) -> str:
    """An --adapter-root as AdapterAccess keeps it: `s3://bucket/prefix` without trailing slashes, or a local
    directory made absolute with symlinks resolved. Raises ValueError for another scheme or an S3 root without
    a bucket or with `.`/`..` segments."""
    if text.startswith(S3_SCHEME):
        key = text[len(S3_SCHEME):].rstrip("/")
        if not key.split("/")[0] or _has_dot_segment(key):
            raise ValueError(f"expected s3://bucket[/prefix] without '.' or '..' segments; got {text!r}")
        return S3_SCHEME + key
    if "://" in text or text.startswith(BUILTIN_PREFIX) or not text or "\0" in text:
        raise ValueError(f"expected a local directory or s3://bucket[/prefix] (built-in adapters are always "
                         f"allowed); got {text!r}")
    return os.path.realpath(os.path.expanduser(text))


def access_for(*, host: str, environ: Mapping[str, str], insecure_open: bool, roots: tuple[str, ...],
               startup_sources: tuple[str, ...]) -> AdapterAccess:
    """The policy of an engine listening on `host`, with the token from `environ` (empty counts as unset)."""
    return AdapterAccess(token=environ.get(ADMIN_TOKEN_ENV) or None,
                         open_without_token=insecure_open or is_loopback_host(host),
                         roots=roots, startup_sources=frozenset(startup_sources))


def startup_notice(access: AdapterAccess, *, host: str, insecure_open: bool) -> tuple[int, str] | None:
    """(logging level, message) that the engine logs at start about its adapter endpoints; None on the quiet
    default (loopback, no token, no flag)."""
    if access.token:
        extra = f" ({INSECURE_FLAG} is ignored)" if insecure_open else ""
        return logging.INFO, f"adapter endpoints need the admin token from ${ADMIN_TOKEN_ENV}{extra}"
    if insecure_open and not is_loopback_host(host):
        return logging.WARNING, (f"adapter endpoints are OPEN without a token to anyone who reaches {host} "
                                 f"({INSECURE_FLAG}); set ${ADMIN_TOKEN_ENV} instead")
    if not access.open_without_token:
        return logging.INFO, (f"adapter endpoints refused: listening on {host} without ${ADMIN_TOKEN_ENV}; "
                              f"set it to enable them")
    return None


def check_caller(access: AdapterAccess, authorization: str | None) -> None:
    """Raise ApiError 401 for a missing or wrong token, 403 when the endpoints are off (no token beyond
    loopback); return when the caller may go on."""
    if access.token:
        require_bearer(authorization, (access.token,), name="engine admin token")
        return
    if not access.open_without_token:
        raise ApiError(403, f"the adapter endpoints are off: this engine listens beyond loopback without an admin "
                       f"token. Set ${ADMIN_TOKEN_ENV} in its environment and send it as 'Authorization: Bearer "
                       f"<token>', or start it with {INSECURE_FLAG}", type="PermissionDeniedError",
                       code="adapter_endpoints_disabled")


def allowed_source(access: AdapterAccess, source: str, resolve: Callable[[str], str] = os.path.realpath) -> str:
    """The source to load for `lora_path`: as given for a built-in, an S3 prefix or a startup source, the
    resolved path for a local directory. Raises ApiError 403, the same for every refused path whether or not
    it exists, when it lies under no root."""
    if source.startswith(BUILTIN_PREFIX) or source in access.startup_sources:
        return source
    if source.startswith(S3_SCHEME):
        key = source[len(S3_SCHEME):].rstrip("/")
        if not _has_dot_segment(key) and any(_under(S3_SCHEME + key, root) for root in access.roots
                                             if root.startswith(S3_SCHEME)):
            return source
        raise _outside_roots()
    if "://" not in source and "\0" not in source:
        resolved = resolve(os.path.expanduser(source))
        if any(_under(resolved, root) for root in access.roots if not root.startswith(S3_SCHEME)):
            return resolved
    raise _outside_roots()


def _under(path: str, root: str) -> bool:
    """`path` is `root` or below it, on a segment boundary (`/srv/ab` is not under the root `/srv/a`)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _has_dot_segment(key: str) -> bool:
    return any(part in (".", "..") for part in key.split("/"))


def _outside_roots() -> ApiError:
    return ApiError(403, "lora_path is not under any adapter root this engine allows; its operator can add one "
                    "with --adapter-root, and built-in adapters (builtin:NAME) are always allowed",
                    type="PermissionDeniedError", param="lora_path", code="adapter_source_not_allowed")
