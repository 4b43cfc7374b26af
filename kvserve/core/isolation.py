"""Who may share cached KV: a request's ``cache_salt`` and its API key's namespace.

Caches shared by every client leak: a prompt served from the prefix cache comes back sooner, so a client
can tell from its own time to first token whether another sent the same prefix lately, and a global
schema registry lets any client use, overwrite or delete another's Prompt Cache schema.

- ``cache_salt`` (vLLM's request field): the salt joins every prompt block's prefix-cache hash, so requests
  with different salts (or one with and one without) never share a block; requests with the same salt share
  as before. A Prompt Cache prompt refuses a salt: its modules are shared by every prompt that imports them
  (one encoding per module), so their isolation boundary is the namespace, not the salt.
- A *namespace* (with several API keys, one per key; otherwise ``""``, the one global namespace) holds its
  own schemas: a schema ``name`` registered in namespace ``ns`` is stored under ``qualified_name(ns, name)``
  (``"<ns>:<name>"``; a schema name never holds ``:``), so its modules' store keys, and with them their
  prefix-cache hashes, differ from another namespace's schema of the same name and text. Plain prompts in
  a namespace are salted with it too: tenants never share prefix blocks (vLLM shares them across keys).
- A namespace is a hash of its key: the key itself is a secret, kept out of logs, names and hashes.
"""

from __future__ import annotations

import hashlib

MAX_CACHE_SALT_CHARS = 256  # ample for a random token or a user id, small enough to hash every block cheaply
GLOBAL_NAMESPACE = ""
NAMESPACE_SEPARATOR = ":"


def namespace_of(api_key: str) -> str:
    """The namespace of an API key: 16 hex digits of a hash, never the key."""
    return hashlib.sha256(b"kvserve-namespace\0" + api_key.encode()).hexdigest()[:16]


def qualified_name(namespace: str, name: str) -> str:
    """The registry's (and the module store's) name for schema ``name`` of ``namespace``."""
    return name if namespace == GLOBAL_NAMESPACE else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def check_cache_salt(cache_salt: object, pml: bool = False) -> None:
    """Raise ``ValueError`` (naming ``cache_salt``) unless it is None or non-empty text of bounded length, and
    unless the prompt is a plain one (``pml``: a Prompt Cache prompt)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt must not be empty (leave it out to share the prefix cache)")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed")
    if pml:
        raise ValueError(
            "cache_salt does not apply to a Prompt Cache prompt: its schema's modules are shared by every prompt "
            "that imports them; schemas are isolated per API key instead (send it as plain text to salt it)"
        )


def prefix_salt(namespace: str, cache_salt: str | None) -> tuple:
    """The prefix-cache hash salt of a plain prompt; ``()`` (shared with every unsalted prompt) for neither."""
    salt: tuple = ()
    if namespace != GLOBAL_NAMESPACE:
        salt += ("namespace", namespace)
    if cache_salt is not None:
        salt += ("cache_salt", cache_salt)
    return salt


def key_namespaces(api_keys: list[str]) -> list[str]:
    """Each key's namespace: its own with two keys or more; the global one for a single key (one tenant, as
    before) or none."""
    if len(api_keys) < 2:
        return [GLOBAL_NAMESPACE] * len(api_keys)
    return [namespace_of(key) for key in api_keys]
