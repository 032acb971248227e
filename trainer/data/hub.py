"""A dataset named on the hub (`data.path=owner/name`), failing fast where the hub is out of reach.

Without a network `datasets` retries each request with back-off (22 tries, 29 s, 2026-12-02)
before it says so. One short connection attempt to the hub's host tells first: out of reach (or
`HF_HUB_OFFLINE=1`), the dataset is read from the local cache only, and a dataset not cached is
one line at once naming data.path and the endpoint.
"""

from __future__ import annotations

import os
import socket
from typing import Optional
from urllib.parse import urlparse

from trainer.data.errors import DataError

PROBE_TIMEOUT_S = 3.0
DEFAULT_ENDPOINT = "https://huggingface.co"


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


def reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the URL's host opens within timeout_s."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _go_offline() -> None:
    """Make `datasets` and `huggingface_hub` use their local caches only, in this process."""
    import datasets
    import huggingface_hub.constants as hub

    hub.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True  # older datasets read this one


def offline_reason() -> Optional[str]:
    """Why the hub cannot be asked (then this process reads local caches only), or None."""
    if _offline():
        return "HF_HUB_OFFLINE is set"
    url = endpoint()
    if not reachable(url):
        _go_offline()
        return f"the hub ({url}) is out of reach"
    return None


def load_named(name: str, split: str, streaming: bool, key: str = "data.path"):
    import datasets

    why = offline_reason()
    offline = why is not None
    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        if offline:
            raise DataError(f"{key}: {name!r} is no file or folder here, and {why}: the dataset "
                            f"is not in the local cache ({type(exc).__name__}: {first}); point "
                            f"{key} at local files, or run where the hub is reachable "
                            "once") from None
        raise DataError(f"{key}: {name!r} is neither a file, a folder nor a dataset the hub "
                        f"could give ({type(exc).__name__}: {first})") from None
