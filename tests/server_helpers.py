"""Helpers of the tests that talk to a running server."""
import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it is true; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
