"""Typed errors of multi-LoRA, mapped once to HTTP at the server's edge:
UnknownAdapter -> 404 (the request named an adapter this replica does not serve),
AdapterLoadError -> 400 (an adapter that cannot be served: bad files, bad shapes, a failed download)."""

from __future__ import annotations


class UnknownAdapter(LookupError):
    """A request or call named an adapter that is not registered (or is being unloaded)."""

    def __init__(self, name: str, registered: tuple[str, ...] = ()) -> None:
        self.name = name
        known = ", ".join(registered) if registered else "none"
        super().__init__(f"unknown adapter {name!r}; registered adapters: {known}")


class AdapterLoadError(ValueError):
    """An adapter cannot be loaded: a missing or malformed file, shapes that do not fit the base model,
    a rank above max_lora_rank, an unsupported target module or option, or a failed download. The
    message names the file (or URL), the key or tensor, the bad value and what is allowed. A failed load
    fails that load call or request only; the engine keeps serving."""
