"""kvgate: one import name for every part.

The subsystems are subpackages (`kvgate.router`, `kvgate.engine`, `kvgate.registry`, `kvgate.autoscaler`,
`kvgate.providers`) whose sources sit at the repository's root; pyproject.toml's package-dir maps them here.
Beside them: the front door (`cli`, `stack`) and shared leaves (`clock`, `state`, the `v1` protocol stubs).

Imports nothing, so importing a leaf such as `kvgate.clock` never pulls in the front door.
"""

# The one place the version is written: pyproject.toml reads it (dynamic version), `kvgate --version` prints it.
__version__ = "0.1.0"
