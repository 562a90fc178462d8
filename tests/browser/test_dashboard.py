"""The dashboard in a real browser against a real stack (broker, Redis, the services, two node agents, real
torch ranks): sign-in, a job going live from queued to succeeded without a reload, its curves and heat map
against the API, cancelling from the page, the Lab on the planner's numbers, an experiment's trials, space and
links to its jobs, the cluster pages; no console errors on any page; a screenshot of each page (see
docs/dashboard.md)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait
from trainyard_api.dashboard import PAGES
from trainyard_cli.stack import LocalStack

from tests.support.api import spec_with
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CAMEL_CASE = re.compile(r"\b[a-z]+[A-Z][A-Za-z0-9]*\b")  # lostWork, masterWeights, tokensPerSecond


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


LABELS_JS = """
  const out = [];
  const leaves = "th, dt, caption, figcaption, summary, option, button, legend, h1, h2, h3, svg text, .legend span";
  for (const el of document.querySelectorAll(leaves)) out.push(el.textContent.trim());
  for (const el of document.querySelectorAll("[title], [aria-label]"))
    out.push(el.getAttribute("title") || "", el.getAttribute("aria-label") || "");
  return out.filter(Boolean);
"""


def camel_case_labels(driver: WebDriver) -> list[str]:
    """The page's labels (headers, captions, legends, options, chart text, titles) that hold a raw field name."""
    return [t for t in driver.execute_script(LABELS_JS) if CAMEL_CASE.search(t)]


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
    refused = "/v1/whoami - Failed to load resource: the server responded with a status of 401"
    assert console_errors(driver, allowed=(refused,)) == []


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
    curve = '[data-series="loss"] polyline'
    drawn = wait(driver, lambda d: int(d.find_element(By.CSS_SELECTOR, curve).get_attribute("data-points")) == expected
                 and expected, "the loss curve with every point the API returned")
    assert drawn == expected

    # the heat map has a row per rank
    timing = api.get(f"/v1/training-jobs/{job_id}/metrics",
                     params={"series": "computeSeconds", "byRank": "true", "maxPoints": 60}).json()
    world = api.get(f"/v1/training-jobs/{job_id}").json()["attempts"][-1]["worldSize"]
    assert len(timing["ranks"]) == world == 2
    assert sorted(attrs(driver, "#heatmap tr[data-rank]", "data-rank", "the heat map")) == sorted(timing["ranks"])
    Select(driver.find_element(By.ID, "heat-series")).select_by_value("collectiveSeconds")
    assert wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#heatmap table").get_attribute("data-series")
                == "collectiveSeconds", "the collective heat map")

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

    # tokens/s is the run's figure: its steps after the first over their time without checkpoint stalls (the
    # last step, the final save, is slower), from the very history the curves draw; the header shows it
    assert len(view["attempts"]) == 1
    timing = api.get(f"/v1/training-jobs/{job_id}/metrics", params={
        "series": "tokensPerSecond,stepSeconds,checkpointSeconds", "maxPoints": 2000}).json()
    assert timing["method"] == "all"
    tps, step_s, stall_s = (timing["series"][k]["values"][1:]
                            for k in ("tokensPerSecond", "stepSeconds", "checkpointSeconds"))
    expected_rate = sum(r * t for r, t in zip(tps, step_s)) / sum(t - c for t, c in zip(step_s, stall_s))
    assert view["progress"]["tokensPerSecond"] == pytest.approx(expected_rate, rel=1e-3)
    shown_rate = attrs(driver, "#job-tokens-per-second", "data-value", "the header's tokens/s")
    assert float(shown_rate[0]) == view["progress"]["tokensPerSecond"]
    # a finished job with data draws it: no "no data yet"; its labels are words
    assert [t for t in driver.execute_script(LABELS_JS) if "yet" in t] == []
    assert camel_case_labels(driver) == []
    assert "Lost work" in driver.find_element(By.ID, "goodput").text
    screenshot(driver, screenshots, "job")
    assert console_errors(driver) == []

    open_page(driver, stack, "jobs")
    row = f'tr[data-job="{job_id}"]'
    state = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, row).get_attribute("data-state"),
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
    dialog = wait(driver, lambda d: d.find_element(By.ID, "confirm") if d.find_element(By.ID, "confirm").is_displayed()
                  else None, "the confirmation")
    assert job_id in dialog.text or "tiny-example" in dialog.text
    dialog.send_keys(Keys.ESCAPE)  # Escape keeps the job
    wait(driver, lambda d: not d.find_element(By.ID, "confirm").is_displayed(), "the dialog to close")
    assert api.get(f"/v1/training-jobs/{job_id}").json()["state"] in {"queued", "running"}

    click(driver, "action-cancel")
    wait(driver, lambda d: d.find_element(By.ID, "confirm").is_displayed(), "the confirmation")
    driver.switch_to.active_element.send_keys(Keys.ENTER)  # focus is on Confirm
    wait(driver, lambda d: api.get(f"/v1/training-jobs/{job_id}").json()["state"] == "cancelled",
         "the API to say cancelled", 60)
    wait(driver, lambda d: d.find_element(By.ID, "job-state").text == "cancelled", "the page to show cancelled", 60)
    # what it left empty says how it ended, never "yet" (the parts redraw after the header)
    placeholders = "svg text.empty, #attempts-empty, #checkpoints-empty, #goodput-empty, #heatmap-empty"
    wait(driver, lambda d: not [e for e in d.find_elements(By.CSS_SELECTOR, placeholders) if "yet" in e.text],
         "the empty parts to say the job ended")
    for text in (e.text for e in driver.find_elements(By.CSS_SELECTOR, placeholders)):
        assert "cancelled" in text or "was not reported" in text, text
    assert console_errors(driver) == []


def test_an_experiments_trials_are_listed_drawn_and_linked_to_their_jobs(
        driver: WebDriver, stack: LocalStack, api: httpx.Client, screenshots: Path) -> None:
    base = spec_with(**{"resources.gpuType": "cpu", "resources.gpuCount": 1, "parallelism.data": 1,
                        "training.maxSteps": 12, "training.globalBatchSize": 8, "checkpointPolicy.everySteps": 6})
    made = api.post("/v1/experiments", json={
        "name": "ui-sweep", "base": base,
        "space": {"training.learningRate": {"low": 1e-3, "high": 3e-2, "log": True},
                  "training.lrSchedule.warmupSteps": {"type": "int", "low": 0, "high": 6}},
        "search": {"algorithm": "random", "seed": 3}, "metric": {"name": "loss", "goal": "minimize"},
        "budget": {"maxTrials": 3}, "maxConcurrentTrials": 3})
    assert made.status_code == 201, made.text
    experiment_id = made.json()["experimentId"]
    sign_in(driver, stack, token_of(stack.token_file))
    open_page(driver, stack, f"experiments/{experiment_id}")
    # the page follows the search by itself, to its end
    wait(driver, lambda d: d.find_element(By.ID, "experiment-state").text == "completed", "the experiment over", 600)
    view = api.get(f"/v1/experiments/{experiment_id}").json()
    assert view["state"] == "completed" and view["best"] is not None, view

    def trial_rows(d: WebDriver) -> list[tuple[str | None, str | None]] | None:
        rows = [(r.get_attribute("data-trial"), r.get_attribute("data-state"))
                for r in d.find_elements(By.CSS_SELECTOR, "#trials tr[data-trial]")]
        return rows if rows and all(s == "completed" for _, s in rows) else None
    assert wait(driver, trial_rows, "every trial's row") == [(str(t["number"]), t["state"]) for t in view["trials"]]
    # one point per trial with a value in each parameter's scatter, the best one marked; a line per trial across
    # the parallel coordinates of both parameters and the metric
    valued = sorted(str(t["number"]) for t in view["trials"] if t["value"] is not None)
    assert len(valued) == 3
    for figure in ('svg[data-scatter="training.learningRate"]', 'svg[data-scatter="training.lrSchedule.warmupSteps"]',
                   'svg[data-parallel="space"]'):
        marks = attrs(driver, f"{figure} [data-key]", "data-key", f"the marks of {figure}")
        assert sorted(marks) == valued, figure
        assert attrs(driver, f"{figure} [data-best]", "data-key", "the best") == [str(view["best"]["trial"])]
    best = driver.find_element(By.ID, "experiment-best").text
    assert view["best"]["jobId"] in best and view["best"]["checkpoint"] in best
    assert not re.search(r"\b(null|undefined|NaN)\b", driver.find_element(By.ID, "main").text)
    assert camel_case_labels(driver) == []
    screenshot(driver, screenshots, "experiment")
    assert console_errors(driver) == []

    # the list: the experiment, its trials done and its best value
    open_page(driver, stack, "experiments")
    row = f'#experiments-body tr[data-experiment="{experiment_id}"]'
    assert attrs(driver, row, "data-state", "the experiment in the list") == ["completed"]
    assert driver.find_element(By.CSS_SELECTOR, f"{row} td:nth-child(3)").text.startswith("3 / 3")
    screenshot(driver, screenshots, "experiments")

    # a trial's job link opens its job page, which names the trial and links back
    click_link = f'{row} a[href="#/experiments/{experiment_id}"]'
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, click_link).click() or True, "the experiment's link")
    trial = view["trials"][1]
    job_link = f'#trials tr[data-trial="1"] a[data-job-link="{trial["jobId"]}"]'
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, job_link).click() or True, "trial 1's job link")
    line = wait(driver, lambda d: d.find_element(By.ID, "job-experiment").text, "the job's experiment")
    assert line.startswith("Trial 1 of experiment ui-sweep")
    assert api.get(f"/v1/training-jobs/{trial['jobId']}").json()["experiment"]["trial"] == 1
    click(driver, "job-experiment-link")
    wait(driver, lambda d: d.find_element(By.ID, "experiment-state").text == "completed", "back at the experiment")
    assert console_errors(driver) == []


def lab_answer(api: httpx.Client, driver: WebDriver, experiment: str, after: str | None = None) -> tuple[dict, dict]:
    """The request the page last sent for ``experiment`` (a newer one than ``after``) and the API's answer to it."""
    out = f"lab-{experiment}-out"
    wait(driver, lambda d: (s := d.find_element(By.ID, out).get_attribute("data-seq")) and s != after,
         f"the {experiment} answer")
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
        cell = driver.find_element(By.CSS_SELECTOR,
                                   f'#scaling-points tr[data-devices="{point["devices"]}"] td[data-value]')
        assert float(cell.get_attribute("data-value")) == pytest.approx(point["stepSeconds"])
    answered = ((p["devices"], p["stepSeconds"]) for p in answer["points"])
    assert any(answer_step > before[d] for d, answer_step in answered if d in before)
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
    bpp = driver.find_element(By.CSS_SELECTOR, '#memory-bytes-per-parameter tr[data-field="masterWeights"] th').text
    assert bpp.lower().startswith("master weights")
    assert camel_case_labels(driver) == []
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
    assert camel_case_labels(driver) == []
    screenshot(driver, screenshots, "goodput")
    assert console_errors(driver) == []

    click(driver, "sign-out")
    wait(driver, lambda d: d.find_element(By.ID, "token"), "the sign-in form")
    screenshot(driver, screenshots, "sign-in")


# ----------------------------------------------------------------------------- the pages' own logic, in the browser
# These load the dashboard's modules from a plain static server (no stack) and run them in Chromium.

@pytest.fixture(scope="module")
def ui() -> Iterator[str]:
    """The dashboard's files over HTTP (module scripts need an origin), without an API."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(PAGES))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def in_page(driver: WebDriver, ui: str, body: str, *args: Any) -> Any:
    """Run ``body`` (async JS with ``charts``, ``format`` and ``job``, the modules, and ``args``) in a page of
    the dashboard's origin; its return value comes back through JSON."""
    if not driver.current_url.startswith(ui):
        driver.get(f"{ui}/index.html")  # no token: the sign-in form, nothing asked of an API
    script = f"""
      const done = arguments[arguments.length - 1], args = JSON.parse(arguments[0]);
      Promise.all(["charts", "format", "job"].map((m) => import("{ui}/" + m + ".js")))
        .then(async ([charts, format, job]) => JSON.stringify(await (async () => {{ {body} }})()))
        .then(done, (e) => done(JSON.stringify({{ error: String(e && e.stack || e) }})));
    """
    result = json.loads(driver.execute_async_script(script, json.dumps(args)))
    assert not (isinstance(result, dict) and "error" in result), result
    return result


CLOCK = ('(ms, step) => new Date(ms).toLocaleString("en-GB", { timeZone: "UTC", month: "short", day: "2-digit", '
         'hour: "2-digit", minute: "2-digit", second: step != null && step < 60000 ? "2-digit" : undefined })')
T0 = 1_796_174_854_000  # 2026-12-02T01:27:34Z, in ms


@pytest.mark.parametrize(("case", "chart"), [
    ("a loss that barely moves", {"steps": list(range(1, 41)), "values": [2.3011 + i * 0.00002 for i in range(40)]}),
    ("three steps", {"steps": [1, 2, 3], "values": [3.0, 2.5, 2.4]}),
    ("one step", {"steps": [7], "values": [1.5]}),
    ("a learning-rate schedule", {"steps": list(range(1, 41)), "values": [3.05e-4 + i * 6.9e-5 for i in range(40)]}),
    ("millions of tokens/s, close together", {"steps": [1, 2, 3, 4], "values": [1.2e6, 1.21e6, 1.24e6, 1.25e6]}),
    ("a flat series", {"steps": [1, 2, 3], "values": [0.5, 0.5, 0.5]}),
    ("a flat percentage", {"steps": [1, 2], "values": [0.5, 0.5001], "format": "(v) => format.pct(v, 0)"}),
    ("forty seconds of goodput samples", {"steps": [T0 + i * 2000 for i in range(21)],
                                          "values": [0.1 + i / 100 for i in range(21)],
                                          "format": "(v) => format.pct(v, 0)", "formatX": CLOCK,
                                          "xSteps": "charts.TIME_STEPS_MS"}),
    ("three hours of goodput samples", {"steps": [T0 + i * 300_000 for i in range(37)], "values": [0.3] * 37,
                                        "format": "(v) => format.pct(v, 0)", "formatX": CLOCK,
                                        "xSteps": "charts.TIME_STEPS_MS"}),
    ("bytes over parameters, both logarithmic", {"steps": [10 ** (6 + i / 10) for i in range(61)],
                                                 "values": [16 * 10 ** (6 + i / 10) for i in range(61)],
                                                 "logX": True, "logY": True, "format": "format.bytes"}),
    ("a log axis inside one decade", {"steps": [150, 400, 900], "values": [1, 2, 3], "logX": True}),
])
def test_a_charts_axis_ticks_are_distinct_labels_inside_the_plot(driver: WebDriver, ui: str, case: str,
                                                                  chart: dict) -> None:
    code = {k: chart.pop(k) for k in ("format", "formatX", "xSteps") if k in chart}
    options = ", ".join(f"{k}: {v}" for k, v in code.items())
    got = in_page(driver, ui, f"""
      const svg = charts.lineChart({{ name: "t", label: "t", ...args[0], {options} }});
      document.body.append(svg);
      const ticks = (axis) => [...svg.querySelectorAll(`text.tick-${{axis}}`)].map((t) => ({{
        label: t.textContent, x: Number(t.getAttribute("x")), y: Number(t.getAttribute("y")) }}));
      const result = {{ x: ticks("x"), y: ticks("y") }};
      svg.remove();
      return result;
    """, chart)
    for axis in ("x", "y"):
        labels = [t["label"] for t in got[axis]]
        assert labels, f"{case}: no {axis} tick"
        assert len(set(labels)) == len(labels), f"{case}: {axis} ticks repeat: {labels}"
        assert len(labels) <= 7, f"{case}: {labels}"
    # inside the plot (viewBox 600 x 200, the plot from x 56 to 590 and y 10 to 176)
    assert all(56 <= t["x"] <= 590 for t in got["x"]), got["x"]
    assert all(10 <= t["y"] - 4 <= 176 for t in got["y"]), got["y"]


def test_every_label_of_the_table_is_in_words_and_so_is_a_name_it_lacks(driver: WebDriver, ui: str) -> None:
    got = in_page(driver, ui, """
      return { table: Object.entries(format.LABELS),
               lacking: ["someNewKind", "optimizerStates2", "plain"].map(format.label) };
    """)
    table = dict(got["table"])
    # the names the pages showed raw
    assert table["lostWork"] == "Lost work" and table["masterWeights"].startswith("Master weights")
    assert {"productive", "inFlight", "launchRestore", "checkpointStall", "hang", "idle", "weights", "gradients",
            "optimizerStates", "optimizer", "total", "ddp", "zero1", "zero2", "fsdp"} <= set(table)
    assert [words for words in table.values() if CAMEL_CASE.search(words)] == []
    assert got["lacking"] == ["Some new kind", "Optimizer states 2", "plain"]


VIEW = {"jobId": "job-1", "state": "running", "attempts": [], "progress": {"globalStep": 0},
        "updatedAt": "2026-12-02T01:27:44Z"}
ATTEMPT = {"attempt": 1, "startedAt": "2026-12-02T01:27:34Z", "endedAt": "2026-12-02T01:27:44Z"}


@pytest.mark.parametrize(("view", "others_have_data", "says"), [
    (VIEW, False, "no data yet"),
    ({**VIEW, "state": "queued"}, False, "no data yet"),
    ({**VIEW, "state": "paused", "attempts": [ATTEMPT]}, False, "no data yet"),
    ({**VIEW, "state": "cancelled"}, False, "no metrics were recorded: the job was cancelled before it started"),
    ({**VIEW, "state": "failed", "attempts": [ATTEMPT]}, False,
     "no metrics were recorded: the job failed before its first step"),
    ({**VIEW, "state": "succeeded", "attempts": [ATTEMPT], "progress": {"globalStep": 40}}, True,
     "MFU was not reported by this run"),
    ({**VIEW, "state": "succeeded", "attempts": [ATTEMPT], "progress": {"globalStep": 40}}, False,
     "no metrics were recorded: the job succeeded at step 40"),
])
def test_an_empty_curve_says_no_data_yet_only_while_the_job_may_still_report(
        driver: WebDriver, ui: str, view: dict, others_have_data: bool, says: str) -> None:
    got = in_page(driver, ui, "return job.emptyCurveText(args[0], 'mfu', args[1]);", view, others_have_data)
    assert got.startswith(says), got
    if view["state"] in {"succeeded", "failed", "cancelled"}:
        assert "yet" not in got
    if view["state"] in {"succeeded", "failed", "cancelled"} and not others_have_data:
        assert "02 Dec 2026" in got  # when it ended


# ----------------------------------------------------------------------------- the experiment pages, on a fake API
# The views are the API's own (``experiment_view`` over an ExperimentRecord); the page's fetch answers them.

EXPERIMENT_ID = "exp-0123456789ab"
TRIALS = [  # (state, learning rate, warm-up steps, value, rungs, reason)
    ("completed", 0.003, 5, 2.10, [2.9, 2.4], None),
    ("completed", 0.01, 10, 2.25, [3.0, 2.5], None),
    ("stopped", 0.0004, 0, 3.60, [3.7], "early stopping: rung 1 at step 10, worse than the best 1/2"),
    ("stopped", 0.02, 20, 2.90, [3.2, 2.9], "early stopping: rung 2 at step 20, worse than the best 1/2"),
    ("failed", 0.0008, 15, None, [], "its job failed: rank 0 exited with code 1"),
    ("running", 0.005, 2, 2.70, [2.8], None),
    ("pending", 0.001, 8, None, [], None),
]


def experiment_json(state: str = "running", best: int | None = None) -> dict[str, Any]:
    """An experiment as GET /v1/experiments/{id} answers: two parameters (a log-scale one), successive halving
    with rungs at steps 10 and 20, every trial state."""
    from trainyard_api.experiments import experiment_view
    from trainyard_contract.experiments import ExperimentRecord, ExperimentSpec, RungDecision, Trial

    spec = ExperimentSpec.model_validate({
        "name": "lr-sweep", "base": spec_with(**{"training.maxSteps": 40}),
        "space": {"training.learningRate": {"low": 3e-4, "high": 3e-2, "log": True},
                  "training.lrSchedule.warmupSteps": {"type": "int", "low": 0, "high": 20}},
        "metric": {"name": "loss", "goal": "minimize"},
        "earlyStopping": {"kind": "successiveHalving", "minSteps": 10, "reductionFactor": 2},
        "budget": {"maxTrials": 8}, "maxConcurrentTrials": 2})
    trials = [Trial(number=n, params={"training.learningRate": lr, "training.lrSchedule.warmupSteps": w},
                    job_id=None if s == "pending" else f"job-{n:012x}", state=s, rungs=r, value=v,
                    last_step=40 if s == "completed" else 10 * len(r), device_hours=0.02 * (len(r) + 1), reason=why)
              for n, (s, lr, w, v, r, why) in enumerate(TRIALS)]
    record = ExperimentRecord(
        experiment_id=EXPERIMENT_ID, tenant="dev", spec=spec, state=state, trials=trials, best_trial=best,
        reason=None if state == "running" else "every trial is over",
        rung_decisions=[RungDecision(rung=0, steps=10, promoted=[0, 1, 3], stopped=[2]),
                        RungDecision(rung=1, steps=20, promoted=[0, 1], stopped=[3])])
    view = experiment_view(record, ("ck-best", 40) if best is not None else None)
    return view.model_dump(mode="json", by_alias=True)


def on_fake_api(driver: WebDriver, ui: str, answers: dict[str, Any], body: str, role: str = "submitter") -> Any:
    """Run ``body`` (async JS with ``exp``, the experiments module, ``main``, ``ctx`` and ``posted``, the paths
    POSTed to) on a page whose ``fetch`` answers ``answers`` (path → JSON) and 404 otherwise."""
    return in_page(driver, ui, f"""
      const answers = args[0], posted = [];
      window.fetch = async (path, init = {{}}) => {{
        if ((init.method || "GET") === "POST") posted.push(path);
        const found = Object.hasOwn(answers, path);
        return new Response(JSON.stringify(found ? answers[path] : {{ detail: "not found" }}),
                            {{ status: found ? 200 : 404, headers: {{ "Content-Type": "application/json" }} }});
      }};
      const exp = await import("{ui}/experiments.js");
      const main = document.createElement("main");
      document.body.replaceChildren(main);
      const page = new AbortController();
      const ctx = {{ signal: page.signal, me: {{ role: args[1] }}, confirm: async () => true }}, id = args[2];
      try {{ {body} }} finally {{ page.abort(); }}
    """, answers, role, EXPERIMENT_ID)


SCATTER_JS = """
  const figure = (p) => {
    const svg = main.querySelector(`figure[data-param="${p}"] svg`);
    return { points: [...svg.querySelectorAll("circle.point")].map((c) => ({ key: Number(c.dataset.key),
               state: c.dataset.state, fill: c.getAttribute("fill"), cx: Number(c.getAttribute("cx")),
               best: c.dataset.best === "true" })),
             ticks: [...svg.querySelectorAll("text.tick-x")].map((t) => t.textContent) };
  };
"""


def test_the_experiment_page_draws_every_trial_and_the_space_searched(driver: WebDriver, ui: str) -> None:
    view = experiment_json(state="completed", best=0)
    got = on_fake_api(driver, ui, {f"/v1/experiments/{EXPERIMENT_ID}": view}, SCATTER_JS + """
      await exp.renderOne(main, { id }, ctx);
      const rows = [...main.querySelectorAll("#trials tbody tr")].map((r) => ({ trial: Number(r.dataset.trial),
        state: r.dataset.state, cells: [...r.cells].map((c) => c.textContent),
        job: r.querySelector("a[data-job-link]")?.getAttribute("href") || null }));
      const headers = [...main.querySelectorAll("#trials thead th")].map((t) => t.textContent);
      const parallel = main.querySelector("svg[data-parallel]");
      return { rows, headers, lr: figure("training.learningRate"), warmup: figure("training.lrSchedule.warmupSteps"),
        lines: parallel ? [...parallel.querySelectorAll("polyline.line")].map((l) => Number(l.dataset.key)) : null,
        state: main.querySelector("#experiment-state").textContent,
        best: main.querySelector("#experiment-best").textContent,
        stop: !!main.querySelector("#experiment-stop"), colors: exp.STATE_COLORS, text: main.textContent };
    """)
    trials = view["trials"]
    # the table: a row per trial in order, each parameter, the metric at each rung, the job link, why it stopped
    assert [(r["trial"], r["state"]) for r in got["rows"]] == [(t["number"], t["state"]) for t in trials]
    assert got["headers"][:4] == ["#", "Learning rate", "Warmup steps", "State"]
    assert "Loss at step 10" in got["headers"] and "Loss at step 20" in got["headers"]
    for row, t in zip(got["rows"], trials):
        assert row["job"] == (f"#/jobs/{t['jobId']}" if t["jobId"] else None)
        assert (t["reason"] or "—") == row["cells"][-1]
    assert got["rows"][2]["cells"][got["headers"].index("Loss at step 20")] == "—"  # stopped at the first rung
    # a point per trial with a value, in every scatter, coloured by state; the best one marked
    valued = {t["number"]: t for t in trials if t["value"] is not None}
    for figure in (got["lr"], got["warmup"]):
        assert sorted(p["key"] for p in figure["points"]) == sorted(valued)
        for p in figure["points"]:
            state = valued[p["key"]]["state"]
            assert p["state"] == state
            assert p["fill"] == got["colors"][state if state in ("completed", "stopped", "failed") else "running"]
        assert [p["key"] for p in figure["points"] if p["best"]] == [0]
        assert len(set(figure["ticks"])) == len(figure["ticks"]) >= 2
    # the learning rate's axis is logarithmic: equal ratios, equal distances
    at = {p["key"]: p["cx"] for p in got["lr"]["points"]}
    lr = {n: t["params"]["training.learningRate"] for n, t in valued.items()}
    ratio = (at[1] - at[0]) / (at[3] - at[0])
    assert ratio == pytest.approx(math.log(lr[1] / lr[0]) / math.log(lr[3] / lr[0]), rel=1e-2)
    # two parameters searched: parallel coordinates too, a line per trial with a value
    assert sorted(got["lines"]) == sorted(valued)
    assert got["state"] == "completed"
    assert "trial 0" in got["best"] and trials[0]["jobId"] in got["best"] and "ck-best" in got["best"]
    assert not got["stop"]  # nothing to stop once it is over
    assert not re.search(r"\b(null|undefined|NaN)\b", got["text"]), got["text"]
    assert camel_case_labels(driver) == []


@pytest.mark.parametrize(("role", "offered"), [("submitter", True), ("viewer", False)])
def test_stop_is_offered_while_the_experiment_runs_to_roles_that_may_and_posts_the_stop_route(
        driver: WebDriver, ui: str, role: str, offered: bool) -> None:
    view = experiment_json(state="running")
    path = f"/v1/experiments/{EXPERIMENT_ID}"
    got = on_fake_api(driver, ui, {path: view, f"{path}/stop": view}, """
      await exp.renderOne(main, { id }, ctx);
      const stop = main.querySelector("#experiment-stop");
      if (stop) { stop.click(); await new Promise((r) => setTimeout(r, 200)); }
      return { offered: !!stop, posted, best: main.querySelector("#experiment-best").textContent };
    """, role)
    assert got["offered"] is offered
    assert got["posted"] == ([f"{path}/stop"] if offered else [])
    assert got["best"].startswith("trial 0 (so far)")  # no best chosen yet: the best value so far


def test_the_experiments_list_counts_the_trials_done_and_shows_the_best(driver: WebDriver, ui: str) -> None:
    running, done = experiment_json(state="running"), experiment_json(state="completed", best=0)
    done = {**done, "experimentId": "exp-00000000000b", "name": "lr-sweep-2"}
    got = on_fake_api(driver, ui, {"/v1/experiments": {"experiments": [running, done]}}, """
      await exp.render(main, {}, ctx);
      return [...main.querySelectorAll("#experiments-body tr")].map((r) => ({ id: r.dataset.experiment,
        state: r.dataset.state, link: r.querySelector("a").getAttribute("href"),
        cells: [...r.cells].map((c) => c.textContent) }));
    """)
    assert [r["id"] for r in got] == [done["experimentId"], EXPERIMENT_ID]  # newest first
    over = sum(t["state"] in ("completed", "stopped", "failed") for t in running["trials"])
    for row in got:
        assert row["link"] == f"#/experiments/{row['id']}"
        assert row["cells"][2].startswith(f"{over} / 8")
        assert row["cells"][3].startswith("2.1")


# ----------------------------------------------------------------------------- evaluations beside the loss curve

EVAL_JOBS = ("job-e7a1e7a1e7a1", "job-e7a2e7a2e7a2")  # the evaluation jobs of HISTORY_JOB's steps 100 and 250


def test_a_jobs_evaluations_are_markers_on_its_loss_curve_and_rows_linking_their_jobs(
        driver: WebDriver, stack: LocalStack, screenshots: Path) -> None:
    import asyncio
    from datetime import UTC, datetime

    from redis.asyncio import Redis
    from trainyard_contract.records import EvaluationResult, JobRecord
    from trainyard_contract.spec import TrainingSpec
    from trainyard_runtime.store import Keys, StateStore

    from tests.support.api import HISTORY_JOB, TOKEN_A, seed_history

    results = [EvaluationResult(evaluation_job_id=job, checkpoint_id=f"{HISTORY_JOB}/checkpoint/step-{step:09d}-a1",
                                global_step=step, metrics={"loss": loss, "perplexity": math.exp(loss)},
                                finished_at=datetime(2026, 12, 2, 1, minute, tzinfo=UTC))
               for job, step, loss, minute in ((EVAL_JOBS[1], 250, 1.875, 40), (EVAL_JOBS[0], 100, 2.5, 30))]

    async def seed() -> None:  # tenant-a's finished job with 300 steps of curves, its two evaluations and their jobs
        redis = Redis.from_url(stack.redis_url)
        try:
            store = StateStore(redis)
            await store.add_token(TOKEN_A, "tenant-a", "alice")
            await seed_history(store)
            for r in results:
                spec = TrainingSpec.model_validate(spec_with(**{
                    "evaluation": {"batches": 4}, "initFrom": {"jobId": HISTORY_JOB, "globalStep": r.global_step}}))
                await store.create_job(JobRecord(job_id=r.evaluation_job_id, tenant="tenant-a", spec=spec,
                                                 spec_hash=spec.spec_hash(), state="succeeded"))
            await redis.hset(Keys.evaluations(HISTORY_JOB), mapping={r.evaluation_job_id: r.dumps() for r in results})
        finally:
            await redis.aclose()

    asyncio.run(seed())
    sign_in(driver, stack, TOKEN_A)
    open_page(driver, stack, f"jobs/{HISTORY_JOB}")
    by_step = sorted(results, key=lambda r: r.global_step)

    # on the loss chart: a marker per evaluation, left to right by step, at the curve's x for that step and the
    # evaluation's loss; its tooltip every metric and the evaluation job; a legend names the series
    markers = wait(driver, lambda d: d.execute_script("""
      const svg = document.querySelector('svg[data-series="loss"]');
      const line = svg && svg.querySelector("polyline");
      const marks = svg ? [...svg.querySelectorAll("a.marker")] : [];
      if (!line || marks.length < 2) return null;
      return { points: line.getAttribute("points").split(" ").map((p) => Number(p.split(",")[0])),
               marks: marks.map((m) => ({ key: m.dataset.marker, step: Number(m.dataset.step),
                 value: Number(m.dataset.value), href: m.getAttribute("href"),
                 title: m.querySelector("title").textContent,
                 x: Number(m.querySelector("path").getAttribute("d").slice(1).split(",")[0]) })) };
    """), "the evaluation markers on the loss chart")
    assert len(markers["marks"]) == len(results)
    assert [m["key"] for m in sorted(markers["marks"], key=lambda m: m["x"])] == [r.evaluation_job_id for r in by_step]
    steps = api_metrics(stack, TOKEN_A, HISTORY_JOB)["series"]["loss"]["steps"]
    for mark, r in zip(sorted(markers["marks"], key=lambda m: m["x"]), by_step):
        assert mark["step"] == r.global_step and mark["value"] == r.metrics["loss"]
        assert mark["x"] == markers["points"][steps.index(r.global_step)]  # on the curve's own x for that step
        assert mark["href"] == f"#/jobs/{r.evaluation_job_id}"
        assert r.evaluation_job_id in mark["title"] and f"step {r.global_step}" in mark["title"]
        assert f"Loss {r.metrics['loss']:g}" in mark["title"] and "perplexity" in mark["title"]
    assert "evaluation (held-out)" in driver.find_element(By.ID, "loss-legend").text

    # the table: a row per evaluation by step, its checkpoint, each metric, a link to its job
    def table_rows(d: WebDriver) -> list[tuple[str | None, list[str], str | None]] | None:
        return [(r.get_attribute("data-evaluation"), [c.text for c in r.find_elements(By.TAG_NAME, "td")],
                 r.find_element(By.CSS_SELECTOR, "a[data-job-link]").get_attribute("href"))
                for r in d.find_elements(By.CSS_SELECTOR, "#evaluations-table tbody tr")] or None
    rows = wait(driver, table_rows, "the evaluations table")
    headers = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#evaluations-table thead th")]
    assert [h.lower() for h in headers] == ["step", "checkpoint", "loss", "perplexity", "evaluation job", "finished"]
    for (key, cells, href), r in zip(rows, by_step, strict=True):
        assert key == r.evaluation_job_id
        assert cells[:4] == [str(r.global_step), r.checkpoint_id.split("/")[-1], f"{r.metrics['loss']:g}",
                             f"{r.metrics['perplexity']:.4g}"]
        assert cells[4] == r.evaluation_job_id and href.endswith(f"#/jobs/{r.evaluation_job_id}")
    assert camel_case_labels(driver) == []
    screenshot(driver, screenshots, "job-evaluations")
    assert console_errors(driver) == []

    # a marker opens its evaluation job's page
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, f'a.marker[data-marker="{EVAL_JOBS[0]}"]').click() or True,
         "the first marker to be clicked")
    wait(driver, lambda d: d.current_url.endswith(f"#/jobs/{EVAL_JOBS[0]}")
         and d.find_element(By.ID, "job-state").text == "succeeded", "the evaluation job's page")
    assert console_errors(driver) == []


def api_metrics(stack: LocalStack, token: str, job_id: str) -> dict[str, Any]:
    """The loss curve as the job page asks for it."""
    answer = httpx.get(f"{stack.s.api_url}/v1/training-jobs/{job_id}/metrics",
                       headers={"Authorization": f"Bearer {token}"},
                       params={"series": "loss,lr,tokensPerSecond,mfu", "maxPoints": 2000})
    assert answer.status_code == 200, answer.text
    return answer.json()


def job_json(state: str, ready_steps: tuple[int, ...]) -> dict[str, Any]:
    """A job as GET /v1/training-jobs/{id} answers (``job_view`` over the records): two ranks, READY checkpoints."""
    from trainyard_api.views import job_view
    from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord
    from trainyard_contract.spec import TrainingSpec

    spec = TrainingSpec.model_validate(spec_with(**{"training.maxSteps": 40}))
    job = JobRecord(job_id="job-000000000001", tenant="dev", spec=spec, spec_hash=spec.spec_hash(), state=state,
                    attempts=[AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2, state="running")])
    checkpoints = [CheckpointRecord(job_id=job.job_id, tenant="dev", attempt=1, epoch=1, global_step=step,
                                    world_size=2, state="READY") for step in ready_steps]
    return job_view(job, None, checkpoints).model_dump(mode="json", by_alias=True)


def evaluation_json(job: str, step: int, metrics: dict[str, float]) -> dict[str, Any]:
    return {"evaluationJobId": job, "checkpointId": f"job-000000000001/checkpoint/step-{step:09d}-a1",
            "globalStep": step, "metrics": metrics, "finishedAt": "2026-12-02T01:30:00Z"}


def test_evaluations_arriving_while_the_job_runs_appear_without_a_reload_and_one_without_a_loss_only_in_the_table(
        driver: WebDriver, ui: str) -> None:
    base = "/v1/training-jobs/job-000000000001"
    steps = list(range(1, 21))
    curves = {"fromStep": 1, "toStep": 20, "method": "all",
              "series": {"loss": {"steps": steps, "values": [4 / s for s in steps], "totalPoints": 20}}}
    first = evaluation_json("job-e00000000010", 10, {"loss": 0.5, "perplexity": math.exp(0.5)})
    later = evaluation_json("job-e00000000020", 20, {"accuracy": 0.42})  # the user's code reported no loss
    answers = {base: job_json("running", (10, 20)), f"{base}/metrics": curves,
               f"{base}/evaluations": {"jobId": "job-000000000001", "evaluations": [first]}}
    in_page(driver, ui, """
      window.__answers = args[0];
      window.fetch = async (path) => {  // the path without its query; anything else (events, logs) a 404
        const found = window.__answers[String(path).split("?")[0]];
        return new Response(JSON.stringify(found || { detail: "not found" }),
                            { status: found ? 200 : 404, headers: { "Content-Type": "application/json" } });
      };
      const main = document.createElement("main");
      main.id = "main";
      document.body.replaceChildren(main, Object.assign(document.createElement("div"), { id: "notice" }));
      window.__page = new AbortController();
      await job.render(main, { id: "job-000000000001" }, { signal: window.__page.signal });
      return true;
    """, answers)
    try:
        def shown(d: WebDriver) -> dict[str, Any]:
            return d.execute_script("""return {
              marks: [...document.querySelectorAll('svg[data-series="loss"] a.marker')].map((m) => m.dataset.marker),
              rows: [...document.querySelectorAll("#evaluations-table tbody tr")].map((r) => r.dataset.evaluation),
              headers: [...document.querySelectorAll("#evaluations-table thead th")].map((t) => t.textContent),
              legend: document.getElementById("loss-legend")?.textContent || "" }""")
        assert wait(driver, lambda d: shown(d)["rows"], "the first evaluation") == [first["evaluationJobId"]]
        assert shown(driver)["marks"] == [first["evaluationJobId"]]
        # the step-20 checkpoint's evaluation arrives: the page reads it again by itself
        driver.execute_script("window.__answers[arguments[0]].evaluations.push(arguments[1])",
                              f"{base}/evaluations", later)
        got = wait(driver, lambda d: g if len((g := shown(d))["rows"]) == 2 else None, "the second evaluation")
        assert got["rows"] == [first["evaluationJobId"], later["evaluationJobId"]]
        assert got["marks"] == [first["evaluationJobId"]]  # no loss: nothing to draw on the loss chart
        assert got["headers"] == ["Step", "Checkpoint", "Loss", "perplexity", "accuracy", "Evaluation job", "Finished"]
        assert "evaluation (held-out)" in got["legend"] and "1 evaluation without a loss" in got["legend"]
        assert console_errors(driver) == []
    finally:
        driver.execute_script("window.__page.abort()")
        driver.get(f"{ui}/index.html")  # a fresh page for the tests after this one


ENDED_AT = "2026-12-02T01:27:44Z"
MINUTE_MS = 60_000


@pytest.mark.parametrize(("state", "ready", "evaluated", "minutes_after_end", "pending"), [
    ("running", (10, 20), (10,), 0, True),  # the step-20 checkpoint's evaluation may come
    ("running", (10, 20), (10, 20), 0, False),  # every READY checkpoint has one
    ("running", (), (), 0, False),  # no READY checkpoint to evaluate
    ("succeeded", (10, 20), (10,), 1, True),  # the last checkpoint's evaluation comes after the job ended
    ("succeeded", (10, 20), (10,), 11, False),  # …but not ten minutes later
])
def test_the_page_reads_the_evaluations_again_only_while_one_may_still_come(
        driver: WebDriver, ui: str, state: str, ready: tuple[int, ...], evaluated: tuple[int, ...],
        minutes_after_end: int, pending: bool) -> None:
    view = {**job_json(state, ready), "updatedAt": ENDED_AT}
    view["attempts"][-1]["endedAt"] = ENDED_AT if state == "succeeded" else None
    evaluations = [evaluation_json(f"job-e{s:011d}", s, {"loss": 1.0}) for s in evaluated]
    now = in_page(driver, ui, f"return Date.parse('{ENDED_AT}') + {minutes_after_end * MINUTE_MS};")
    assert in_page(driver, ui, "return job.evaluationsPending(args[0], args[1], args[2]);",
                   view, evaluations, now) is pending
