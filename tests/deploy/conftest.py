"""The Helm chart, loaded once per module by Helm's own library (helm-python-sdk), and
rendered with each of the values sets every chart test runs on."""

import helm_python as helm
import pytest

from helm_render import CHART, VALUE_SETS, _render


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def case(request, chart):
    """(user values, the chart's merged values, rendered objects) for one values set."""
    values = VALUE_SETS[request.param]
    return values, chart.merge_values(values), _render(chart, values)
