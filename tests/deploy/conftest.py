"""The Helm chart, loaded once per module by Helm's own library (helm-python-sdk)."""

from pathlib import Path

import helm_python as helm
import pytest

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c
