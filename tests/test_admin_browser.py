"""The admin's lists and the one-time API key page in a real browser (the suite's headless
Chromium, as tests/test_dashboard_browser.py drives it), at 800 and 1,400 px: every column an
operator acts on or README promises lies inside the visible area, measured from the element
boxes Chromium laid out; the new key is whole and copyable; a reload makes no second key.

Against Django's live test server in this process (no workers needed: their heartbeats are
written to Redis as a worker would). Screenshots go to $DASHBOARD_SCREENSHOTS if set.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.models import Worker
from routing.state.redis_keys import sync_client
from tenants.keys import create_api_key
from tenants.models import ApiKey, Tenant
from tenants.usage import TenantUsage
from tests.test_dashboard_browser import (
    NARROW,
    WIDE,
    chromium_paths,
    full_page_screenshot,
    screenshots_dir,
    set_width,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

PASSWORD = "admin-browser-pw-7c1"
# Each header cell of the change list, with how far its box reaches past what can be seen: the
# window, or the results box when that scrolls sideways (overflow: auto hides what lies past it).
HEADER_BOXES_JS = """
const results = document.querySelector('#changelist .results');
const box = results.getBoundingClientRect();
const visibleRight = Math.min(document.documentElement.clientWidth, box.left + results.clientWidth);
return [...document.querySelectorAll('#result_list thead th')].map(th => ({
  column: th.className.split(' ').filter(c => c.startsWith('column-'))[0] || th.className,
  text: th.innerText.trim(),
  left: th.getBoundingClientRect().left,
  right: th.getBoundingClientRect().right,
  visibleRight: visibleRight,
}));
"""
# Rows' cells too: a cell's text must not spill past its column (e.g. a long URL on one line).
CELL_OVERFLOW_JS = """
const limit = document.documentElement.clientWidth;
return [...document.querySelectorAll('#result_list tbody td, #result_list tbody th')]
  .filter(c => c.getBoundingClientRect().right > limit + 1 || c.scrollWidth > c.clientWidth + 1)
  .map(c => c.className + ' ' + c.innerText.slice(0, 40));
"""
WORKER_COLUMNS = (
    "column-name", "column-live", "column-role_name", "column-enabled", "column-draining", "column-in_flight",
    "column-device", "column-model_name", "column-session_scoped", "column-shared_image_cache",
)  # fmt: skip
TENANT_COLUMNS = (
    "column-name", "column-sharing", "column-limits", "column-usage_requests", "column-usage_prompt_tokens",
    "column-usage_cached_tokens", "column-usage_completion_tokens", "column-usage_refused",
)  # fmt: skip
KEY_COLUMNS = (
    "column-name", "column-tenant", "column-masked", "column-kind", "column-state", "column-last_used",
    "column-expires_at",
)  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    binary, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WIDE},1000")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def operator(live_server, browser: webdriver.Chrome) -> webdriver.Chrome:
    """The browser, logged into the live server's admin as a superuser."""
    get_user_model().objects.create_superuser("operator", password=PASSWORD)
    browser.delete_all_cookies()
    browser.get(f"{live_server.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    until(lambda: browser.current_url, lambda url: "/login/" not in url, what="the login")
    return browser


@pytest.fixture
def fleet(settings) -> Iterator[None]:
    """Two live workers with long but real-looking values, as operators' fleets have."""
    registry = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    for index, name in enumerate(("gpu-node-07-a", "gpu-node-07-b")):
        model = "Qwen2.5-VL-7B-Instruct"
        Worker.objects.create(name=name, model_name=model, device=f"cuda:{index}", draining=index == 1)
        registry.beat(
            Heartbeat(
                name=name,
                model=model,
                block_size=settings.KV_BLOCK_SIZE,
                device=f"cuda:{index}",
                session_scoped=index == 0,
                shared_image_cache="redis://:***@image-cache.internal.example:6379/3",
            ),
            60,
        )
    yield
    for name in ("gpu-node-07-a", "gpu-node-07-b"):
        registry.remove(name)


@pytest.fixture
def tenants_with_usage(settings) -> Iterator[None]:
    usage = TenantUsage(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    made = []
    for name, share in (("vision-team-production", True), ("research-batch-jobs", False)):
        tenant = Tenant.objects.create(
            name=name,
            share_prefix_cache=share,
            requests_per_minute=12000,
            prompt_tokens_per_minute=4_000_000,
            max_concurrent_requests=256,
        )
        usage.record(tenant.pk, prompt=123_456_789, cached=98_765_432, completion=12_345_678)
        create_api_key(tenant, f"continuous integration of {name}", staff=share)
        made.append(tenant.pk)
    yield
    sync_client(settings.REDIS_URL).delete(*(usage.key(pk) for pk in made))


def columns_out_of_sight(driver: webdriver.Chrome, wanted: tuple[str, ...]) -> list[str]:
    boxes = driver.execute_script(HEADER_BOXES_JS)
    present = {box["column"] for box in boxes}
    missing = [column for column in wanted if column not in present]
    hidden = [
        f"{box['column']} ({box['text']!r}: right edge {box['right']:.0f} > {box['visibleRight']:.0f})"
        for box in boxes
        if box["right"] > box["visibleRight"] + 1
    ]
    return missing + hidden


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_every_column_of_the_workers_tenants_and_keys_lists_is_in_sight(
    live_server, operator: webdriver.Chrome, fleet, tenants_with_usage, width: int, tmp_path: Path
) -> None:
    driver, shots = operator, screenshots_dir(tmp_path)
    set_width(driver, width)
    for page, wanted in (
        ("routing/worker", WORKER_COLUMNS),
        ("tenants/tenant", TENANT_COLUMNS),
        ("tenants/apikey", KEY_COLUMNS),
    ):
        driver.get(f"{live_server.url}/admin/{page}/")
        full_page_screenshot(driver, shots / f"{page.replace('/', '-')}-{width}.png", width)
        assert columns_out_of_sight(driver, wanted) == [], f"{page} at {width} px"
        assert driver.execute_script(CELL_OVERFLOW_JS) == [], f"{page} at {width} px: a cell spills"
        overflow = "return document.documentElement.scrollWidth - document.documentElement.clientWidth;"
        assert driver.execute_script(overflow) <= 0, f"{page} scrolls sideways at {width} px"


def test_the_one_time_key_is_whole_and_copyable_at_800_px_and_a_reload_makes_none(
    live_server, operator: webdriver.Chrome, tmp_path: Path
) -> None:
    driver, shots = operator, screenshots_dir(tmp_path)
    Tenant.objects.create(name="vision-team-production")
    set_width(driver, NARROW)
    # the page may write to the clipboard, as a user's click allows
    driver.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": live_server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )

    # when an operator creates a key at 800 px
    driver.get(f"{live_server.url}/admin/tenants/apikey/add/")
    Select(driver.find_element(By.NAME, "tenant")).select_by_visible_text("vision-team-production")
    driver.find_element(By.NAME, "name").send_keys("laptop of the on-call operator")
    driver.find_element(By.CSS_SELECTOR, "input[name=_save]").click()
    until(lambda: driver.current_url, lambda url: url.endswith("/created/"), what="the created page")
    full_page_screenshot(driver, shots / "api-key-created-800.png", NARROW)

    # then the whole key lies inside the window, wrapped, nothing clipped
    key = driver.find_element(By.ID, "new-api-key")
    plaintext = key.text.replace("\n", "")
    assert plaintext.startswith("sk-") and len(plaintext) > 40
    box = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return {left: r.left, right: r.right, clipped: arguments[0].scrollWidth - arguments[0].clientWidth,"
        " window: document.documentElement.clientWidth};",
        key,
    )
    assert box["left"] >= 0 and box["right"] <= box["window"] and box["clipped"] <= 0, box
    assert (
        driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth;"
        )
        <= 0
    )

    # and its copy button puts exactly the key on the clipboard
    driver.find_element(By.ID, "copy-api-key").click()
    until(
        lambda: driver.find_element(By.ID, "copy-api-key-status").text,
        lambda t: t == "Copied.",
        what="copied",
    )
    copied = driver.execute_async_script(
        "navigator.clipboard.readText().then(arguments[arguments.length - 1]);"
    )
    assert copied == plaintext
    assert ApiKey.objects.get(name="laptop of the on-call operator").prefix in plaintext

    # when the page is reloaded
    driver.refresh()
    # then no second key exists and the secret is not shown again
    until(lambda: driver.find_element(By.ID, "key-shown-already").text, bool, what="shown already")
    assert plaintext not in driver.page_source
    assert ApiKey.objects.filter(name="laptop of the on-call operator").count() == 1
