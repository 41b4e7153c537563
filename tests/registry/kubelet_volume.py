"""A Kubernetes ConfigMap volume on local disk, maintained the way the kubelet does it.

The kubelet does not rewrite files in place. It writes each new version of the ConfigMap into a fresh
hidden directory named by timestamp, points a `..data` symlink at it with an atomic rename, and removes
the old directory; the files the container sees are symlinks through `..data`:

    registry/
      ..2026_01_01_00_00_00.000000001/models.yaml    the real files of one version
      ..data -> ..2026_01_01_00_00_00.000000001      swapped atomically (rename of ..data_tmp)
      models.yaml -> ..data/models.yaml              what `kvgate router --registry registry/` reads

Used by the registry watcher's tests and by the Helm chart's tests (which play the kubelet).
"""

from __future__ import annotations

import os
from pathlib import Path


class KubeletVolume:
    """A ConfigMap volume as the kubelet's AtomicWriter maintains it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True)
        self.num_versions = 0

    def publish(self, files: dict[str, str]) -> None:
        """Write `files` ({key: content}) as the next version, in AtomicWriter's steps: the payload into
        a new timestamped directory, `..data_tmp` pointed at it and renamed onto `..data` (the atomic
        swap), user-visible symlinks created for new keys, those of keys that left removed, and last
        the previous timestamped directory removed."""
        self.num_versions += 1
        version_dir = self.root / f"..2026_01_01_00_00_{self.num_versions:02d}.000000001"
        version_dir.mkdir()
        for key, text in files.items():
            (version_dir / key).write_text(text)
        old_target = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        tmp_link = self.root / "..data_tmp"
        tmp_link.symlink_to(version_dir.name)
        os.replace(tmp_link, self.root / "..data")  # the atomic swap
        for key in files:
            if not (self.root / key).is_symlink():
                (self.root / key).symlink_to(Path("..data") / key)
        for entry in self.root.iterdir():
            if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in files:
                entry.unlink()
        if old_target:
            for stale in (self.root / old_target).iterdir():
                stale.unlink()
            (self.root / old_target).rmdir()
