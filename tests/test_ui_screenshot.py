"""The Prefect UI as a user meets it: the deployments, a finished run of the tiny deployment (its
steps, its artifacts with the run summary first, the report with its plots) and the nightly trend.

Debian's headless Chromium (`apt-get install -y chromium`) is driven over the DevTools protocol
(the `websockets` client Prefect already depends on): open a page, wait until what it must show is
on it, take a screenshot. The PNGs are kept under out/test-artifacts/ (EAGLET_TEST_ARTIFACTS to move
them): deployments.png, flow-run.png, flow-run-steps.png, flow-run-artifacts.png, run-summary.png,
flow-run-report.png, flow-run-report-plots.png, nightly-trend.png.

    .venv/bin/python -m pytest tests/test_ui_screenshot.py -x -q
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.prefect_server import REPO, free_port, stop_group

pytest_plugins = ["tests.fixtures.prefect_server"]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
ARTIFACTS = Path(os.environ.get("EAGLET_TEST_ARTIFACTS", REPO / "out" / "test-artifacts"))


class Chromium:
    """One headless Chromium page, driven over the DevTools protocol."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1300):
        from websockets.sync.client import connect

        port = free_port()
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(profile.parent / "chromium.log", "wb"), start_new_session=True)
        self._id = 0
        page = self._page_target(port)
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)

    def _page_target(self, port: int, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    return pages[0]
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"chromium gave no DevTools page on port {port} in {timeout} s")

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # events come in between; the answer carries our id
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def text(self) -> str:
        r = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''", returnByValue=True)
        return r["result"].get("value") or ""

    def open(self, url: str, expect: list[str], timeout: float = 90) -> str:
        """Navigate and wait until every expected string is in the page's text; returns that text."""
        self.call("Page.navigate", url=url)
        return self.wait_for(expect, timeout)

    def click(self, label: str) -> None:
        """Click the first button, tab or link whose text is exactly `label`."""
        js = ("(() => { const el = [...document.querySelectorAll('button, a, [role=tab], li')]"
              f".find(e => e.innerText && e.innerText.trim() === {json.dumps(label)});"
              " if (el) { el.click(); return true; } return false; })()")
        if not self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get("value"):
            raise AssertionError(f"nothing labelled {label!r} to click on the page")

    def wait_for(self, expect: list[str], timeout: float = 60) -> str:
        deadline, text = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(s in text for s in expect):
                time.sleep(1.0)  # let the run graph's canvas finish drawing
                return text
            time.sleep(0.5)
        missing = [s for s in expect if s not in text]
        raise AssertionError(f"{missing} not on the page after {timeout} s; it shows:\n{text[:2000]}")

    def dom(self) -> str:
        r = self.call("Runtime.evaluate", expression="document.documentElement.outerHTML", returnByValue=True)
        return r["result"]["value"]

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def scroll_to_plot(self, index: int) -> None:
        """Bring the index-th plot of the page to the top of its scrolling pane (one below the fold)."""
        self.call("Runtime.evaluate", expression=f"{self.PLOTS}[{index}].scrollIntoView()")
        time.sleep(0.5)

    PLOTS = "[...document.images].filter(i => i.src.startsWith('data:image/png'))"  # the report's plots

    def images_loaded(self) -> int:
        """How many of the report's plots have been drawn (one that failed to decode has no width)."""
        js = f"{self.PLOTS}.filter(i => i.complete && i.naturalWidth > 0).length"
        return self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"]["value"]

    def close(self) -> None:
        self.ws.close()
        stop_group(self.proc)


@pytest.fixture
def chromium(tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium: apt-get install -y chromium")
    browser = Chromium(tmp_path / "profile")
    try:
        yield browser
    finally:
        browser.close()


def _artifacts(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(  # "result": Prefect's own, not listed
            flow_run_id={"any_": [flow_run_id]}, type={"not_any_": ["result"]}))


def test_the_deployments_page_lists_one_deployment_per_preset(deployed, prefect_api, chromium):
    from tests.fixtures.prefect_server import PRESET_DEPLOYMENTS

    chromium.open(f"{prefect_api.ui_url}/deployments",
                  expect=[name.split("/")[1] for name in PRESET_DEPLOYMENTS] + ["nightly", "train-draft-nightly"])
    assert chromium.screenshot(ARTIFACTS / "deployments.png").stat().st_size > 20_000


def test_flow_run_page_shows_completed_steps_the_summary_first_and_the_report(tiny_run, prefect_api, chromium):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(tiny_run.flow_run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
    artifacts = _artifacts(run.id)
    assert run.state.is_completed(), run.state.message
    ui = prefect_api.ui_url

    chromium.open(f"{ui}/runs/flow-run/{run.id}", expect=[run.name, "Completed"])
    assert run.name in chromium.dom()
    shot = chromium.screenshot(ARTIFACTS / "flow-run.png")
    assert shot.stat().st_size > 20_000, "a blank page is a few KB"

    assert tasks and all(t.state.is_completed() for t in tasks)
    chromium.click("Task Runs")
    chromium.wait_for([t.name for t in tasks] + [f"({len(tasks)} Completed)"])
    chromium.screenshot(ARTIFACTS / "flow-run-steps.png")

    from tasks.evaluate import REPORT_KEY, SUMMARY_KEY

    chromium.click("Artifacts")
    text = chromium.wait_for([a.key for a in artifacts])
    assert text.index(SUMMARY_KEY) < min(text.index(a.key) for a in artifacts if a.key != SUMMARY_KEY), \
        "the run summary is the first artifact the run's page lists"
    chromium.screenshot(ARTIFACTS / "flow-run-artifacts.png")

    summary = next(a for a in artifacts if a.key == SUMMARY_KEY)
    chromium.open(f"{ui}/artifacts/artifact/{summary.id}", expect=["What the figures mean", "acceptance length"])
    chromium.screenshot(ARTIFACTS / "run-summary.png")

    report = next(a for a in artifacts if a.key == REPORT_KEY)
    first_line = next(line.lstrip("# ").strip() for line in str(report.data).splitlines() if line.strip())
    chromium.open(f"{ui}/artifacts/artifact/{report.id}", expect=[first_line[:30], "Training loss"])
    assert chromium.images_loaded() == 2, "the loss curve and the per-position plot are drawn"
    chromium.screenshot(ARTIFACTS / "flow-run-report.png")
    chromium.scroll_to_plot(1)  # the acceptance per position, below the fold
    chromium.screenshot(ARTIFACTS / "flow-run-report-plots.png")


def test_the_nightly_trend_is_a_table_in_the_ui(nightly_run, prefect_api, chromium):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(nightly_run.flow_run_id)
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{nightly_run.output[-3000:]}"
    (trend,) = [a for a in _artifacts(run.id) if a.key == "nightly-trend-default"]
    chromium.open(f"{prefect_api.ui_url}/artifacts/artifact/{trend.id}",
                  expect=[run.parameters["run_name"], "acceptance length", "promoted"])
    chromium.screenshot(ARTIFACTS / "nightly-trend.png")
