import pytest

pytest_plugins = ["cluster_fixtures"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep each lab's grading tests on one xdist worker, so the expensive module fixtures
    (generate, autograde, the hanging submission) run once per lab."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "lab" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"lab-{callspec.params['lab']}"))
