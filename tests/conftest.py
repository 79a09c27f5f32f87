import pytest

pytest_plugins = ["cluster_fixtures"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, keep the tests that share an expensive fixture on one worker, so that
    it is built once: each lab's grading tests (generate, autograde, the hanging submission),
    and a module's tests that use one of its module-scoped fixtures (launches of many ranks).
    A test already placed in a group by its own mark stays there."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "lab" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"lab-{callspec.params['lab']}"))
        elif any(definitions[-1].scope == "module"
                 for definitions in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
