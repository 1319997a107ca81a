"""Under CI (``CI=true``) a skip fails the run, except a ``gpu`` test's on a machine without a GPU
(``tests/conftest.py``): checked on a small suite run by pytest's ``pytester``."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# The suite's hooks, and nothing else of its conftest (no model fixtures, no GPU probe).
CONFTEST = "from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401\n"
INI = "[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n"

TESTS = """
import pytest

def test_runs():
    pass

def test_skips_at_run_time():
    pytest.skip("vllm is broken")

@pytest.mark.skipif(True, reason="no peft here")
def test_skipif():
    pass

def test_importorskip():
    pytest.importorskip("a_package_that_is_not_installed")

@pytest.mark.gpu
@pytest.mark.skip(reason="needs a CUDA GPU")
def test_on_a_gpu():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    raise AssertionError
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_under_ci_a_skip_fails_unless_it_is_a_gpu_test_without_a_gpu(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    # a skip at setup (a mark) fails as an error, one in the test as a failure: either fails the run
    result.assert_outcomes(passed=1, failed=2, errors=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    for message in (  # each names its test and its skip reason
        "test_skips_at_run_time skipped under CI=true (vllm is broken)",
        "test_skipif skipped under CI=true (no peft here)",
        "test_importorskip skipped under CI=true (could not import 'a_package_that_is_not_installed'",
    ):
        assert message in out


def test_outside_ci_a_skip_is_a_skip(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    suite.runpytest().assert_outcomes(passed=1, skipped=4, xfailed=1)


def test_under_ci_a_module_skipped_at_collection_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_vllm='import pytest\n\npytest.importorskip("a_package_that_is_not_installed")\n\n\n'
        "def test_generates():\n    pass\n"
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_vllm.py skipped under CI=true (could not import*"])
    assert result.ret != 0
