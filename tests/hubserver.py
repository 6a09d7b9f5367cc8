"""The ``hub`` fixture: a started test Hub (:mod:`loaderplug.testing.hub`) that
``huggingface_hub`` in this process and its children use.

Use from a test module: ``from tests.hubserver import hub as hub`` (the redundant alias marks an
explicit re-export; a plain ``import hub  # noqa: F401`` still gets ruff F811 on every test
parameter named ``hub``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loaderplug.testing.hub import HubServer, client_env


@pytest.fixture
def hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HubServer]:
    """A started :class:`HubServer` that ``huggingface_hub`` in this process (and children) uses.

    Environment (for subprocesses, which import ``huggingface_hub`` afresh): ``HF_ENDPOINT``,
    ``HF_HUB_DISABLE_XET``, ``HF_HUB_DISABLE_TELEMETRY``, ``HF_HUB_DISABLE_IMPLICIT_TOKEN``, a
    private ``HF_HOME`` (no token file, default cache inside it), ``NO_PROXY`` for 127.0.0.1, and
    no token or offline variables. The same values are patched into ``huggingface_hub.constants``,
    which reads them at import time, and the shared HTTP client is dropped so a fresh one (which
    reads the proxy variables when built) is made.
    """
    constants = pytest.importorskip("huggingface_hub.constants")
    from huggingface_hub import close_session

    home = tmp_path_factory.mktemp("hf_home")
    with HubServer() as server:
        for name, value in client_env(server.endpoint, home).items():
            monkeypatch.setenv(name, value)
        for name in (
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
        ):
            monkeypatch.delenv(name, raising=False)
        template = server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        patched: dict[str, object] = {
            "ENDPOINT": server.endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": template,
            "HF_HUB_DISABLE_XET": True,
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_TOKEN_PATH": str(home / "token"),
        }
        for attribute, setting in patched.items():
            monkeypatch.setattr(constants, attribute, setting)
        close_session()
        try:
            yield server
        finally:
            close_session()
