"""Shared fixtures: traced graphs are computed once per session (tracing is meta-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qsync_opt import ModelGraph, trace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def resnet50_graph() -> ModelGraph:
    return trace("resnet50")


@pytest.fixture(scope="session")
def bert_graph() -> ModelGraph:
    return trace("bert_base")


@pytest.fixture(scope="session")
def digits_graph() -> ModelGraph:
    return trace("digits_cnn")
