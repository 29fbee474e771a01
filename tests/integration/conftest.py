from __future__ import annotations

import pytest

from tests.integration.cluster import Cluster


@pytest.fixture
def cluster(tmp_path, request):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(c.logs())
        c.close()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
