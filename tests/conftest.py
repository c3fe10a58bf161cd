"""Shared test fixtures."""

from __future__ import annotations
