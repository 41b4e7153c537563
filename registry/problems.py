"""What is wrong with a registry, said so that a person can fix it without reading our code.

Every problem names the file and line, the document (kind and name), the key path inside it, and a
message that gives the bad value and what is allowed. Loading collects every problem in a directory
before failing, so one run of `kvgate registry validate` lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass

KeyPath = tuple[str | int, ...]


def format_path(path: KeyPath) -> str:
    """`("spec", "offers", 0, "price_usd_per_hour")` -> `spec.offers[0].price_usd_per_hour`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


@dataclass(frozen=True, order=True)
class Problem:
    file: str
    line: int  # 1-based; 0 when the problem is about the file or directory as a whole
    document: str  # "Model/llama-3-8b", "Model/?" when the name itself is missing, "" for file-level problems
    path: KeyPath
    message: str
    column: int = 0  # 1-based; 0 when only the line is known (YAML syntax errors know the column)

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        if self.line and self.column:
            where += f":{self.column}"
        parts = [where]
        if self.document:
            parts.append(self.document)
        if self.path:
            parts.append(format_path(self.path))
        return ": ".join(parts) + ": " + self.message


class RegistryInvalid(Exception):
    """A registry did not validate. `problems` holds every problem found, sorted by file and line."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = sorted(problems)
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        lines = [str(p) for p in self.problems]
        super().__init__(f"{count} {noun} in {source}:\n" + "\n".join(lines))
