"""Debian packages a test session installs when they are missing, as root (CI, containers), so
that the suite sets itself up on a clean machine."""

from __future__ import annotations

import os
import shutil
import subprocess


class NotInstallable(RuntimeError):
    """Packages are missing and cannot be installed here (the message says why)."""


def apt_install(*packages: str) -> None:
    """``apt-get install -y --no-install-recommends`` the packages, after ``apt-get update``.

    :raises NotInstallable: not root, no apt-get, or apt-get failed.
    """
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NotInstallable(
            f"{', '.join(packages)} missing and only root can install it here: "
            f"apt-get install -y {' '.join(packages)}"
        )
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *packages],
    ):
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise NotInstallable(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
