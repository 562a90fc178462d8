"""The dashboard in a real browser against a real stack (broker, Redis, the services, two node agents, real
torch ranks): sign-in, a job going live from queued to succeeded without a reload, its curves and heat map
against the API, cancelling from the page, the Lab on the planner's numbers, the cluster pages; no console
errors on any page; a screenshot of each page (see docs/dashboard.md)."""

from __future__ import annotations

import os

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait
from trainyard_cli.stack import LocalStack

from tests.support.api import spec_with
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # the goodput history samples every second into 2-second buckets here (5 minutes by default), so the
    # Goodput page has intervals of the jobs the tests before it train
    fast = {"TRAINYARD_GOODPUT_REFRESH_S": "1", "TRAINYARD_GOODPUT_HISTORY_BUCKET_S": "2"}
    saved = {k: os.environ.get(k) for k in fast}
    os.environ.update(fast)
    try:
        yield from running_stack(tmp_path_factory, "dashboard")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def token_of(path: Path) -> str:
    return path.read_text().strip().splitlines()[0]


@pytest.fixture(scope="module")
def api(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.s.api_url, timeout=10,
                      headers={"Authorization": f"Bearer {token_of(stack.token_file)}"}) as client:
        yield client


def wait(driver: WebDriver, until: Callable[[WebDriver], Any], what: str, timeout_s: float = 30) -> Any:
    """``until`` returns something truthy; live updates redraw parts of a page, so an element found a moment
    ago may be gone: asked again."""
    return WebDriverWait(driver, timeout_s, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(until, message=f"waited for {what}")


def attrs(driver: WebDriver, css: str, name: str, what: str) -> list[str]:
    """The ``name`` attribute of every element ``css`` selects (at least one), read in one go: a live redraw
    may replace the elements between finding them and reading them."""
    return wait(driver, lambda d: [e.get_attribute(name) for e in d.find_elements(By.CSS_SELECTOR, css)] or None, what)


def click(driver: WebDriver, element_id: str) -> None:
    def clicked(d: WebDriver) -> bool:
        d.find_element(By.ID, element_id).click()
        return True
    wait(driver, clicked, f"#{element_id} to be clicked")


def console_errors(driver: WebDriver, allowed: tuple[str, ...] = ()) -> list[str]:
    """The browser log's errors since the last call (Selenium hands each entry out once)."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


def screenshot(driver: WebDriver, directory: Path, name: str) -> None:
    """The whole page at the laptop's width, from the top."""
    driver.execute_script("window.scrollTo(0, 0); document.activeElement?.blur()")
    height = driver.execute_script("return Math.max(document.body.scrollHeight, 768)")
    driver.set_window_size(1366, min(height + 120, 4000))
    try:
        driver.save_screenshot(str(directory / f"{name}.png"))
    finally:
        driver.set_window_size(1366, 768)


def sign_in(driver: WebDriver, stack: LocalStack, token: str) -> None:
    # forget the last test's token on a page of the same origin that runs no script (clearing it under a live
    # dashboard races that page's own requests, which would then go out without a token)
    driver.get(f"{stack.s.api_url}/healthz")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{stack.s.api_url}/")  # the root redirects to the dashboard
    box = wait(driver, lambda d: d.find_element(By.ID, "token"), "the sign-in form")
    box.send_keys(token, Keys.ENTER)
    wait(driver, lambda d: d.find_element(By.ID, "who").text, "the signed-in header")


def open_page(driver: WebDriver, stack: LocalStack, route: str) -> None:
    driver.get(f"{stack.s.api_url}/ui/#/{route}")


def submit(api: httpx.Client, **changes: Any) -> str:
    spec = spec_with(**{"resources.gpuType": "cpu", **changes})
    response = api.post("/v1/training-jobs", json=spec)
    assert response.status_code == 202, response.text
    return response.json()["jobId"]


def test_a_wrong_token_shows_the_apis_message_and_the_form_again(driver: WebDriver, stack: LocalStack) -> None:
    driver.get(f"{stack.s.api_url}/ui/")
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    wait(driver, lambda d: d.find_element(By.ID, "token"), "the sign-in form").send_keys("not-a-token", Keys.ENTER)
    message = wait(driver, lambda d: d.find_element(By.ID, "signin-error").text, "the refusal")
    expected = httpx.get(f"{stack.s.api_url}/v1/whoami", headers={"Authorization": "Bearer not-a-token"})
    assert expected.status_code == 401
    assert expected.json()["detail"] in message
    assert driver.find_element(By.ID, "token").is_displayed()
    assert not driver.find_element(By.ID, "nav").is_displayed()
    # the refused request is the only thing the console reports
    assert console_errors(driver, allowed=("/v1/whoami - Failed to load resource: the server responded with a status of 401",)) == []


def test_the_job_page_goes_live_from_queued_to_succeeded_and_draws_what_the_api_serves(
        driver: WebDriver, stack: LocalStack, api: httpx.Client, screenshots: Path) -> None:
    sign_in(driver, stack, token_of(stack.token_file))
    job_id = submit(api, **{"training.maxSteps": 40, "checkpointPolicy.everySteps": 20})
    open_page(driver, stack, f"jobs/{job_id}")
    first = wait(driver, lambda d: d.find_element(By.ID, "job-state").text, "the job's state")
    assert first in {"queued", "running"}
    driver.execute_script("window.__sameDocument = true")  # a reload would lose it
    seen = {first}

    def finished(d: WebDriver) -> bool:
        seen.add(d.find_element(By.ID, "job-state").text)
        return "succeeded" in seen

    wait(driver, finished, "the page to show the job succeeded", timeout_s=300)
    assert driver.execute_script("return window.__sameDocument === true"), "the page reloaded"
    assert api.get(f"/v1/training-jobs/{job_id}").json()["state"] == "succeeded"
    assert "running" in seen or first == "running"

    # the loss curve has as many points as the API returns for the page's query
    metrics = api.get(f"/v1/training-jobs/{job_id}/metrics",
                      params={"series": "loss,lr,tokensPerSecond,mfu", "maxPoints": 2000}).json()
    expected = len(metrics["series"]["loss"]["steps"])
    assert expected > 0
    drawn = wait(driver, lambda d: int(d.find_element(By.CSS_SELECTOR, '[data-series="loss"] polyline').get_attribute("data-points")) == expected
                 and expected, "the loss curve with every point the API returned")
    assert drawn == expected

    # the heat map has a row per rank
    timing = api.get(f"/v1/training-jobs/{job_id}/metrics",
                     params={"series": "computeSeconds", "byRank": "true", "maxPoints": 60}).json()
    world = api.get(f"/v1/training-jobs/{job_id}").json()["attempts"][-1]["worldSize"]
    assert len(timing["ranks"]) == world == 2
    assert sorted(attrs(driver, "#heatmap tr[data-rank]", "data-rank", "the heat map")) == sorted(timing["ranks"])
    Select(driver.find_element(By.ID, "heat-series")).select_by_value("collectiveSeconds")
    assert wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#heatmap table").get_attribute("data-series") == "collectiveSeconds", "the collective heat map")

    # checkpoints and attempts as the API lists them
    view = api.get(f"/v1/training-jobs/{job_id}").json()
    listed = wait(driver, lambda d: [r.get_attribute("data-checkpoint")
                                     for r in d.find_elements(By.CSS_SELECTOR, "#checkpoints tr[data-checkpoint]")],
                  "the checkpoints table")
    assert listed == [c["checkpointId"] for c in view["checkpoints"]]
    for c in view["checkpoints"]:  # the coordinator recorded each READY one's size; the table shows it
        if c["state"] == "READY":
            assert c["sizeBytes"] > 0
            cell = wait(driver, lambda d, i=c["checkpointId"]: d.find_element(
                By.CSS_SELECTOR, f'#checkpoints tr[data-checkpoint="{i}"] td:nth-child(5)').text, "a checkpoint's size")
            assert cell.endswith(("B", "KiB", "MiB", "GiB")), cell
    assert len(driver.find_elements(By.CSS_SELECTOR, "#attempts-timeline [data-attempt]")) == len(view["attempts"])
    wait(driver, lambda d: d.find_element(By.ID, "logs").text.strip(), "rank 0's log lines")
    screenshot(driver, screenshots, "job")
    assert console_errors(driver) == []

    open_page(driver, stack, "jobs")
    state = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]').get_attribute("data-state"),
                 "the job in the list")  # read in one go: a live redraw may replace the row between two calls
    assert state == "succeeded"
    screenshot(driver, screenshots, "jobs")
    assert console_errors(driver) == []

    # "Open in the Lab" fills the Lab with the job's model and measured times
    open_page(driver, stack, f"jobs/{job_id}")
    wait(driver, lambda d: d.find_element(By.ID, "open-lab"), "Open in the Lab")
    click(driver, "open-lab")
    model = wait(driver, lambda d: d.find_element(By.ID, "mem-model").get_attribute("value"), "the Lab")
    assert model == view["spec"]["modelConfig"]
    assert driver.find_element(By.ID, "lab-from-job").is_displayed()
    wait(driver, lambda d: d.find_element(By.ID, "lab-checkpoint-out").get_attribute("data-seq"), "the Lab's answers")
    assert console_errors(driver) == []


def test_cancelling_from_the_page_cancels_the_job(driver: WebDriver, stack: LocalStack, api: httpx.Client) -> None:
    sign_in(driver, stack, token_of(stack.token_file))
    job_id = submit(api, **{"training.maxSteps": 100_000})
    open_page(driver, stack, f"jobs/{job_id}")
    wait(driver, lambda d: d.find_element(By.ID, "action-cancel"), "the cancel button")
    click(driver, "action-cancel")
    dialog = wait(driver, lambda d: d.find_element(By.ID, "confirm") if d.find_element(By.ID, "confirm").is_displayed() else None, "the confirmation")
    assert job_id in dialog.text or "tiny-example" in dialog.text
    dialog.send_keys(Keys.ESCAPE)  # Escape keeps the job
    wait(driver, lambda d: not d.find_element(By.ID, "confirm").is_displayed(), "the dialog to close")
    assert api.get(f"/v1/training-jobs/{job_id}").json()["state"] in {"queued", "running"}

    click(driver, "action-cancel")
    wait(driver, lambda d: d.find_element(By.ID, "confirm").is_displayed(), "the confirmation")
    driver.switch_to.active_element.send_keys(Keys.ENTER)  # focus is on Confirm
    wait(driver, lambda d: api.get(f"/v1/training-jobs/{job_id}").json()["state"] == "cancelled", "the API to say cancelled", 60)
    wait(driver, lambda d: d.find_element(By.ID, "job-state").text == "cancelled", "the page to show cancelled", 60)
    assert console_errors(driver) == []


def lab_answer(api: httpx.Client, driver: WebDriver, experiment: str, after: str | None = None) -> tuple[dict, dict]:
    """The request the page last sent for ``experiment`` (a newer one than ``after``) and the API's answer to it."""
    out = f"lab-{experiment}-out"
    wait(driver, lambda d: (s := d.find_element(By.ID, out).get_attribute("data-seq")) and s != after, f"the {experiment} answer")
    request = json.loads(driver.find_element(By.ID, out).get_attribute("data-request"))
    response = api.post(f"/v1/lab/{experiment}", json=request)
    assert response.status_code == 200, response.text
    return request, response.json()


def shown(driver: WebDriver, css: str) -> float:
    return float(driver.find_element(By.CSS_SELECTOR, css).get_attribute("data-value"))


def test_the_labs_three_experiments_react_and_show_the_planners_numbers(
        driver: WebDriver, stack: LocalStack, api: httpx.Client, screenshots: Path) -> None:
    sign_in(driver, stack, token_of(stack.token_file))
    open_page(driver, stack, "lab")

    # 1. memory: the per-device total is the planner's; FSDP divides it
    request, answer = lab_answer(api, driver, "memory")
    total = driver.find_element(By.CSS_SELECTOR, '#memory-per-device tr[data-field="totalBytes"] td')
    assert int(float(total.get_attribute("data-bytes"))) == answer["perDevice"]["totalBytes"]
    ddp_total = answer["perDevice"]["totalBytes"]
    seq = driver.find_element(By.ID, "lab-memory-out").get_attribute("data-seq")
    Select(driver.find_element(By.ID, "mem-sharding")).select_by_value("fsdp")
    request, answer = lab_answer(api, driver, "memory", after=seq)
    assert request["sharding"] == "fsdp"
    total = driver.find_element(By.CSS_SELECTOR, '#memory-per-device tr[data-field="totalBytes"] td')
    assert int(float(total.get_attribute("data-bytes"))) == answer["perDevice"]["totalBytes"] < ddp_total

    # 2. scaling: a slower interconnect, the planner's step times and where adding devices stops helping
    request, answer = lab_answer(api, driver, "scaling")
    before = {p["devices"]: p["stepSeconds"] for p in answer["points"]}
    seq = driver.find_element(By.ID, "lab-scaling-out").get_attribute("data-seq")
    slider = driver.find_element(By.ID, "scale-inter")
    slider.send_keys(Keys.HOME)  # the slowest interconnect, from the keyboard
    request, answer = lab_answer(api, driver, "scaling", after=seq)
    assert request["interconnectGBps"] == 1
    for point in answer["points"]:
        cell = driver.find_element(By.CSS_SELECTOR, f'#scaling-points tr[data-devices="{point["devices"]}"] td[data-value]')
        assert float(cell.get_attribute("data-value")) == pytest.approx(point["stepSeconds"])
    assert any(answer_step > before[d] for d, answer_step in ((p["devices"], p["stepSeconds"]) for p in answer["points"]) if d in before)
    if answer["stopsHelpingAt"] is not None:
        assert shown(driver, "#scaling-stops [data-value]") == answer["stopsHelpingAt"]

    # 3. checkpoint interval: the Young/Daly optimum moves with the MTBF
    request, answer = lab_answer(api, driver, "checkpoint")
    assert shown(driver, "#checkpoint-optimum [data-value]") == pytest.approx(answer["optimumSeconds"])
    first = answer["optimumSeconds"]
    first_text = driver.find_element(By.CSS_SELECTOR, "#checkpoint-optimum [data-value]").text
    seq = driver.find_element(By.ID, "lab-checkpoint-out").get_attribute("data-seq")
    mtbf = driver.find_element(By.ID, "ckpt-mtbf")
    mtbf.clear()  # an emptied field is named on the page, not sent to the planner (no 422 in the console below)
    WebDriverWait(driver, 20).until(lambda d: "MTBF (hours)" in d.find_element(By.ID, "lab-checkpoint-status").text)
    mtbf.send_keys(str(request["mtbfHours"] * 4), Keys.ENTER)
    request, answer = lab_answer(api, driver, "checkpoint", after=seq)
    assert shown(driver, "#checkpoint-optimum [data-value]") == pytest.approx(answer["optimumSeconds"])
    assert answer["optimumSeconds"] == pytest.approx(2 * first)  # Young: sqrt(2 x write x MTBF)
    assert driver.find_element(By.CSS_SELECTOR, "#checkpoint-optimum [data-value]").text not in ("", "—", first_text)
    screenshot(driver, screenshots, "lab")
    assert console_errors(driver) == []


def test_cluster_queue_topology_and_goodput_pages(driver: WebDriver, stack: LocalStack, screenshots: Path) -> None:
    admin = token_of(stack.admin_token_file)
    sign_in(driver, stack, admin)
    open_page(driver, stack, "cluster")
    cluster = httpx.get(f"{stack.s.api_url}/v1/cluster", headers={"Authorization": f"Bearer {admin}"}).json()
    types = attrs(driver, "#capacity tr[data-device-type]", "data-device-type", "the capacity table")
    assert sorted(types) == sorted(c["deviceType"] for c in cluster["capacity"])
    nodes = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#topology [data-node]"), "the topology")
    assert len(nodes) == 2
    assert len(driver.find_elements(By.CSS_SELECTOR, "#topology .device")) == 8
    screenshot(driver, screenshots, "cluster")
    assert console_errors(driver) == []

    open_page(driver, stack, "goodput")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#goodput-tenants tr[data-tenant]"), "the goodput table")
    history = httpx.get(f"{stack.s.api_url}/v1/goodput/history", params={"all": "true"},
                        headers={"Authorization": f"Bearer {admin}"}).json()
    figures = attrs(driver, "#goodput-history figure[data-history]", "data-history", "the goodput history")
    assert figures[0] == history["tenant"]  # the caller's tenant first
    assert set(figures) >= set(history.get("tenants", {}))
    # the tenant that trained (dev, the job-page test's) has intervals with allocated device-time
    def dev_intervals() -> list[dict]:
        body = httpx.get(f"{stack.s.api_url}/v1/goodput/history", params={"all": "true"},
                         headers={"Authorization": f"Bearer {admin}"}).json()
        return [i for i in body.get("tenants", {}).get("dev", []) if i["allocatedDeviceSeconds"] > 0]
    wait(driver, lambda d: dev_intervals(), "goodput intervals of the dev tenant", timeout_s=60)
    driver.refresh()
    points = attrs(driver, '#goodput-history figure[data-history="dev"] polyline[data-points]', "data-points",
                   "the dev tenant's goodput curve")
    assert int(points[0]) >= 1
    screenshot(driver, screenshots, "goodput")
    assert console_errors(driver) == []

    click(driver, "sign-out")
    wait(driver, lambda d: d.find_element(By.ID, "token"), "the sign-in form")
    screenshot(driver, screenshots, "sign-in")
