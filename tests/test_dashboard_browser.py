"""The live dashboard in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, which scripts/ensure_chromium.sh installs) driven by Selenium against the
real platform.

Screenshots go to $DASHBOARD_SCREENSHOTS if set, else to the test's temporary directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.observed_platform import ADMIN_PASSWORD, ADMIN_USER, WORKERS, ObservedPlatform

WIDE, NARROW = 1400, 800
# Scrollbars aside, what the page lays out wider than the window (0: no horizontal scrolling).
OVERFLOW_JS = "return document.documentElement.scrollWidth - document.documentElement.clientWidth;"
# Elements whose right edge lies beyond the window, by a CSS selector path, for a readable failure.
OFF_SCREEN_JS = """
const limit = document.documentElement.clientWidth;
return [...document.querySelectorAll('#dashboard *')]
  .filter(e => e.getClientRects().length && e.getBoundingClientRect().right > limit + 1
               && !e.closest('.table-scroll'))
  .slice(0, 5).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right));
"""
# The admin's change list scrolls its results table inside the page: that counts as well.
LIST_OVERFLOW_JS = """
const results = document.querySelector('#changelist .results');
return Math.max(document.documentElement.scrollWidth - document.documentElement.clientWidth,
                results ? results.scrollWidth - results.clientWidth : 0);
"""
FAILED_FILES_JS = """
return performance.getEntriesByType('resource')
  .filter(e => e.responseStatus === 0 || e.responseStatus >= 400)
  .map(e => e.name + ' ' + e.responseStatus);
"""


@pytest.fixture(scope="module")
def browser(chromium: tuple[str, str]) -> Iterator[webdriver.Chrome]:
    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WIDE},1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def until(
    read: Callable[[], Any], check: Callable[[Any], bool], timeout: float = 30.0, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = read()
        except (StaleElementReferenceException, NoSuchElementException):  # mid-repaint, or not yet
            value = None
        if value is not None and check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: last saw {value!r}")
        time.sleep(0.3)


def set_width(driver: webdriver.Chrome, width: int) -> None:
    """The viewport (not the window) this wide, so CSS sees exactly `width` px."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
    )
    time.sleep(0.5)  # the dashboard repaints its charts 150 ms after a resize


def full_page_screenshot(driver: webdriver.Chrome, path: Path, width: int) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight;")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    time.sleep(0.3)
    driver.save_screenshot(str(path))
    set_width(driver, width)


def number(driver: webdriver.Chrome, figure: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'#numbers [data-figure="{figure}"] .value').text


def requests_in_chart_table(driver: webdriver.Chrome) -> int:
    """The sum of the request counts in the throughput chart's data table (one row per minute)."""
    cells = driver.execute_script(
        "return [...document.querySelectorAll("
        '\'[data-chart="throughput"] .chart-data td[data-series="requests"]\')].map(td => td.textContent);'
    )
    return sum(int(text) for text in cells if text.isdigit())


def chart_table(driver: webdriver.Chrome, chart: str) -> dict[str, list[str]]:
    """A chart's data table by series: its cells, newest minute first."""
    return driver.execute_script(
        "const table = {};"
        f"for (const td of document.querySelectorAll('[data-chart=\"{chart}\"] .chart-data td[data-series]'))"
        "  (table[td.dataset.series] = table[td.dataset.series] || []).push(td.textContent);"
        "return table;"
    )


def measured(cells: list[str]) -> bool:
    """Some minute of the series holds a figure (a minute with none shows —)."""
    return any(cell not in ("—", "") for cell in cells)


def dashboard_workers(driver: webdriver.Chrome) -> list[str]:
    """The workers in the dashboard's workers table, by name."""
    rows = driver.find_elements(By.CSS_SELECTOR, "#workers tr[data-worker]")
    return sorted(row.get_attribute("data-worker") for row in rows)


def worker_state(driver: webdriver.Chrome, worker: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'#workers tr[data-worker="{worker}"] td.state').text


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def screenshots_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_dashboard_in_a_browser_shows_what_was_sent_follows_a_drain_and_fits_800_px(
    observed_platform: ObservedPlatform, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    platform, driver = observed_platform, browser
    shots = screenshots_dir(tmp_path)
    set_width(driver, WIDE)

    # given: an operator logged into the admin, and requests with repeated images
    driver.get(f"{platform.base_url}/admin/login/")
    driver.find_element(By.NAME, "username").send_keys(ADMIN_USER)
    driver.find_element(By.NAME, "password").send_keys(ADMIN_PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    until(lambda: driver.current_url, lambda url: "/login/" not in url, what="the login")
    # the admin index's link to the dashboard reads on one line, its description inside the module
    link = driver.find_element(By.CSS_SELECTOR, "#live-dashboard-module th a")
    assert link.text == "Live dashboard"
    assert driver.execute_script("return arguments[0].getClientRects().length;", link) == 1, "one line"
    module = driver.find_element(By.ID, "live-dashboard-module")
    assert driver.execute_script("return arguments[0].scrollWidth - arguments[0].clientWidth;", module) <= 0
    for image in (0, 0, 1, 0):
        assert platform.send(image).status_code == 200
    assert platform.send_with_a_wrong_key().status_code == 401  # a client's mistake, not an error of ours

    # when: the dashboard is open on the last hour
    driver.get(f"{platform.base_url}/admin/dashboard/?minutes=60")

    # then: the big number and the chart's data table reach what was sent (the page polls)
    sent = platform.ledger.requests
    until(lambda: number(driver, "requests"), lambda v: v == str(sent), what=f"{sent} requests on the page")
    until(lambda: requests_in_chart_table(driver), lambda v: v == sent, what="the chart's data table")
    # the workers flush their cache counters on their own clock (about once a second), apart from
    # the frontend's request counts, so the hit rate may reach the page a poll later
    until(
        lambda: number(driver, "hit_kv"),
        lambda v: v not in ("—", "0.0%"),
        what="repeated images hitting the KV prefix cache",
    )
    assert number(driver, "overlap_given_up").endswith("%)"), "the router's overlap figures reached the page"
    charts = driver.find_elements(By.CSS_SELECTOR, "#charts .chart")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#charts .uplot")) == len(charts) == 15, (
        "every chart drew"
    )
    # the admission queue's charts and figures: nothing waited for a worker, nothing was shed
    admission = until(
        lambda: chart_table(driver, "admission"), lambda t: set(t) == {"waiting", "shed"}, what="admission"
    )
    assert not any(cell.isdigit() and int(cell) for cell in admission["shed"]), admission
    assert set(chart_table(driver, "admission_wait")) == {"p50", "p90", "p99"}
    assert number(driver, "shed") == "0"
    # 5xx apart from 4xx and 429: the wrong key is a client error, and nothing is red
    until(
        lambda: number(driver, "client_errors"),
        lambda v: v.startswith("1 ("),
        what="the 401 as a client error",
    )
    assert number(driver, "server_errors") == "0" and number(driver, "rate_limited") == "0"
    assert not driver.find_elements(By.CSS_SELECTOR, '#numbers [data-figure="server_errors"].bad')
    assert "errors" not in [
        box.get_attribute("data-figure") for box in driver.find_elements(By.CSS_SELECTOR, "#numbers .number")
    ]
    errors = until(
        lambda: chart_table(driver, "errors"), lambda t: "HTTP 401" in t, what="the 401 in the table"
    )
    column_sum = lambda cells: sum(int(cell) for cell in cells if cell.isdigit())  # noqa: E731
    assert column_sum(errors["4xx client"]) == 1 and column_sum(errors["5xx server"]) == 0
    # end-to-end and inter-token latency, queue depth and KV pool use over time, per worker
    for chart in ("latency", "inter_token"):
        table = until(
            lambda c=chart: chart_table(driver, c), lambda t: measured(t.get("p50", [])), what=chart
        )
        assert set(table) == {"p50", "p90", "p99"}
    for chart in ("queue", "kv_usage"):
        table = until(lambda c=chart: chart_table(driver, c), lambda t: set(t) == set(WORKERS), what=chart)
        assert all(measured(cells) for cells in table.values()), (chart, table)
    # requests/s on an axis of its own: the throughput chart has a right-hand one
    right_axis = '[data-chart="throughput"] .u-axis'
    assert len(driver.find_elements(By.CSS_SELECTOR, right_axis)) == 3, "time, tokens/s and requests/s axes"
    # the worker table says which KV figure is which: prefix hits apart from KV cache use
    headings = [
        th.get_attribute("textContent").strip()
        for th in driver.find_elements(By.CSS_SELECTOR, "#workers thead th")
    ]
    assert "Prefix hit" in headings and "KV use" in headings and "KV" not in headings
    assert (
        "of prefix misses"
        in driver.find_element(By.CSS_SELECTOR, '[data-figure="hit_embedding"] .label').text
    )
    full_page_screenshot(driver, shots / "dashboard-1400.png", WIDE)
    assert driver.execute_script(OVERFLOW_JS) <= 0

    # when: the window changes to 5 minutes
    driver.find_element(By.CSS_SELECTOR, '.windows a[data-minutes="5"]').click()
    until(lambda: driver.current_url, lambda url: url.endswith("minutes=5"), what="the 5-minute window")
    start_of_window = (int(time.time() // 60) - 4) * 60
    # then: it shows that window's requests
    until(
        lambda: number(driver, "requests"),
        lambda v: v == str(platform.ledger.requests_since(start_of_window)),
        what="the 5-minute window's requests",
    )
    assert "5 minutes" in driver.find_element(By.ID, "numbers-title").text

    # when: an operator drains a worker in the workers list (which fits 1,400 px)
    drained = WORKERS[1]
    driver.get(f"{platform.base_url}/admin/routing/worker/")
    full_page_screenshot(driver, shots / "workers-1400.png", WIDE)
    assert driver.execute_script(LIST_OVERFLOW_JS) <= 0, "the workers list scrolls sideways at 1,400 px"
    driver.find_element(By.CSS_SELECTOR, f'input.action-select[value="{worker_pk(driver, drained)}"]').click()
    Select(driver.find_element(By.NAME, "action")).select_by_value("drain")
    driver.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    until(
        lambda: message(driver), lambda text: text == f"Draining: {drained}.", what="the admin's confirmation"
    )
    try:
        # then: the dashboard shows its new state
        driver.get(f"{platform.base_url}/admin/dashboard/?minutes=5")
        try:
            until(
                lambda: worker_state(driver, drained), lambda s: s == "draining", what=f"{drained} draining"
            )
        except AssertionError:
            driver.save_screenshot(str(shots / "failed-drain.png"))
            raise
        assert worker_state(driver, WORKERS[0]) == "serving"
    finally:
        enable_again(driver, platform, drained)

    # when: the operator narrows the dashboard to the model its workers serve
    driver.get(f"{platform.base_url}/admin/dashboard/?minutes=60&model=demo")
    # then: the model filter marks it, and the workers table holds that model's workers
    current = driver.find_element(By.CSS_SELECTOR, 'nav.models a[aria-current="page"]')
    assert current.get_attribute("data-model") == "demo"
    until(lambda: dashboard_workers(driver), lambda names: names == sorted(WORKERS), what="demo's workers")
    # and a model no worker serves shows none of them, while the window's figures stay
    driver.get(f"{platform.base_url}/admin/dashboard/?minutes=60&model=no-such-model")
    until(lambda: dashboard_workers(driver), lambda names: names == [], what="no worker of no-such-model")
    # and "All models" takes the filter off
    driver.find_element(By.CSS_SELECTOR, 'nav.models a[data-model=""]').click()
    until(lambda: driver.current_url, lambda url: "model=" not in url, what="the filter off")
    until(lambda: dashboard_workers(driver), lambda names: names == sorted(WORKERS), what="every worker")

    # and the routing policy page fits 1,400 px too
    driver.get(f"{platform.base_url}/admin/routing/routingpolicysettings/")
    full_page_screenshot(driver, shots / "policy-1400.png", WIDE)
    assert driver.execute_script(OVERFLOW_JS) <= 0, "the policy page scrolls sideways at 1,400 px"

    # when: the dashboard is 800 px wide, in light and in dark mode
    driver.get(f"{platform.base_url}/admin/dashboard/?minutes=60")
    until(lambda: number(driver, "requests"), lambda v: v == str(platform.ledger.requests), what="the page")
    set_width(driver, NARROW)
    full_page_screenshot(driver, shots / "dashboard-800.png", NARROW)
    # then: nothing lies off screen (wide tables scroll inside their card)
    assert driver.execute_script(OVERFLOW_JS) <= 0
    assert driver.execute_script(OFF_SCREEN_JS) == []
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    )
    time.sleep(0.5)
    full_page_screenshot(driver, shots / "dashboard-800-dark.png", NARROW)
    assert driver.execute_script(OVERFLOW_JS) <= 0
    background = driver.execute_script("return getComputedStyle(document.body).backgroundColor;")
    assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), "the admin's dark theme applies"

    # and no script failed, and every file the pages asked for arrived
    assert console_errors(driver) == []
    assert driver.execute_script(FAILED_FILES_JS) == []
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert any(name.endswith("/static/vendor/uplot/uPlot.iife.min.js") for name in loaded)
    assert any(name.endswith("/static/dashboard/dashboard.js") for name in loaded)


def worker_pk(driver: webdriver.Chrome, name: str) -> str:
    """The primary key of the worker's row in the admin's list (its checkbox value)."""
    for row in driver.find_elements(By.CSS_SELECTOR, "#result_list tbody tr"):
        if row.find_element(By.CSS_SELECTOR, "th, td.field-name").text.strip() == name:
            return row.find_element(By.CSS_SELECTOR, "input.action-select").get_attribute("value")
    raise AssertionError(f"no row for worker {name}")


def message(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.CSS_SELECTOR, ".messagelist li").text


def enable_again(driver: webdriver.Chrome, platform: ObservedPlatform, name: str) -> None:
    """Leave the shared platform as the test found it: both workers serving."""
    driver.get(f"{platform.base_url}/admin/routing/worker/")
    driver.find_element(By.CSS_SELECTOR, f'input.action-select[value="{worker_pk(driver, name)}"]').click()
    Select(driver.find_element(By.NAME, "action")).select_by_value("enable")
    driver.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    until(lambda: message(driver), lambda text: text == f"Enabled, not draining: {name}.", what="re-enabled")
