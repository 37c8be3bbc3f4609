"""Registers the ``container`` marker (pyproject's --strict-markers needs every marker named)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "container: builds the image with podman and runs it (root, about 1-2 min cold); "
        "deselect with -m 'not container' or DISAGG_CONTAINER_TESTS=0",
    )
