"""A headless Chromium for tests, from the distribution's packages (installed when missing).

The suite sets itself up: when ``chromium`` or ``chromedriver`` is missing and the session runs
as root (CI, containers), it runs ``apt-get install -y chromium chromium-driver`` (after
``apt-get update``). When that cannot be done the browser tests fail, never skip.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing as t
from pathlib import Path

from . import debian
from .pgcluster import ROOT

PACKAGES = ("chromium", "chromium-driver")
#: Screenshots and other things a person may want to look at after a run (gitignored).
ARTIFACTS = ROOT / "tests" / "artifacts"
ARGUMENTS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def binaries() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
    )
    return (browser, driver) if browser and driver else None


def ensure_binaries() -> tuple[str, str]:
    """Chromium and its driver, installed from the distribution when missing.

    :raises RuntimeError: they are missing and cannot be installed (say why).
    """
    found = binaries()
    if found is not None:
        return found
    debian.apt_install(*PACKAGES)
    found = binaries()
    if found is None:
        raise RuntimeError("chromium or chromedriver still missing after apt-get install")
    return found


def start(browser: str, driver: str) -> t.Any:
    """A Selenium session on a headless Chromium with a fresh profile (never Selenium
    Manager: nothing is downloaded)."""
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ARGUMENTS:
        options.add_argument(argument)
    profile = tempfile.mkdtemp(prefix="flask-idem-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    session.set_page_load_timeout(30)
    session._flask_idem_profile = profile  # removed by stop()
    return session


def stop(session: t.Any) -> None:
    try:
        session.quit()
    finally:
        shutil.rmtree(getattr(session, "_flask_idem_profile", ""), ignore_errors=True)


def screenshot(session: t.Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    height = session.execute_script("return document.documentElement.scrollHeight")
    session.set_window_size(1400, max(800, min(int(height) + 40, 4000)))
    session.save_screenshot(str(path))
    print(f"\nscreenshot: {path}")
    return path
