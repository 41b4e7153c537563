"""The README's metrics reference names every series the gateway, the engine and the autoscaler export."""

from __future__ import annotations

import re

from tests.observability.observability import REPO, exported_metric_names


def test_every_exported_series_is_in_the_readmes_reference() -> None:
    readme = (REPO / "README.md").read_text()
    reference = readme[readme.index("## Observability"):readme.index("## Providers")]
    documented = set(re.findall(r"`(kvgate_[a-z0-9_]+)`", reference))
    exported = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported_metric_names()}
    assert not sorted(exported - documented), "README's metrics reference lacks these"
    assert not sorted(documented - exported), "README's metrics reference names series nobody exports"
