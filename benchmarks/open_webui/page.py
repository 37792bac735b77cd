"""Open WebUI's web page in a headless Chromium, as a user meets it: the page loaded, its
release notes closed, a message typed and sent, the answer read once it has streamed to
the end (the message's action buttons appear). Run by run.py in Open WebUI's venv
(Playwright drives the machine's own Chromium: nothing is downloaded).

    python page.py URL CHROMIUM MESSAGE   # prints PAGE_RESULT {"answer": ..., ...}
"""

from __future__ import annotations

import json
import sys
import time

from playwright.sync_api import sync_playwright

RESULT_MARK = "PAGE_RESULT "
# Chromium as the machine's closed network wants it: none of its own background requests.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]  # fmt: skip
# Shown beside the last answer once it has ended (Open WebUI 0.12's ids).
ANSWER_DONE = "#continue-response-button"


def main(url: str, chromium: str, message: str) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url, wait_until="load", timeout=120_000)
        page.wait_for_selector("#chat-input", timeout=120_000)
        release_notes = page.get_by_text("Okay, Let's Go!")
        if release_notes.count():
            release_notes.click()
        started = time.monotonic()
        page.locator("#chat-input").click()
        page.keyboard.type(message)
        page.keyboard.press("Enter")
        page.wait_for_selector(ANSWER_DONE, timeout=300_000)
        answer = page.locator("#response-content-container").last.inner_text()
        seconds = round(time.monotonic() - started, 1)  # a guide to the wait, not a timing
        print(RESULT_MARK + json.dumps({"answer": answer, "chat": page.url, "seconds": seconds}))
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
