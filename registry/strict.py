"""The base of every registry value: frozen, unknown fields refused; and the error a validator raises to
point at one field. A leaf, so that `schema` and `tenant` share it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FieldProblem(ValueError):
    """A validator's complaint about one field of the model it validates, so errors point at that key."""

    def __init__(self, field: str | tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.path: tuple[str, ...] = (field,) if isinstance(field, str) else field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
