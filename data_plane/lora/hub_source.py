"""Adapters on the Hugging Face Hub: ``hf://ORG/REPO[@REVISION]`` is a model repository holding
``adapter_config.json`` and ``adapter_model.safetensors`` at its root.

huggingface_hub does the talking: the Hub's own client, which knows its download API (resolve
routes, redirects to its storage, Xet), reads ``HF_ENDPOINT`` and ``HF_TOKEN`` the way every Hub tool
does, and downloads atomically into a directory. The revision (a branch, a tag, ``main`` when none is
given) is resolved to a commit first and both files are read at that commit, so they always come from
the same snapshot; the commit is recorded with the copy and logged. The token comes from --hf-token-file
(read at each download, so a rotated Secret takes effect), else from ``HF_TOKEN`` or the Hub's token
file; it is sent to the Hub only and never written into a message.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from data_plane.errors import AdapterNotFound, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.disk_tier import CONFIG_FILE, WEIGHTS_FILE

_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}$")
_REVISION = re.compile(r"^[\w.\-/]{1,200}$")


@dataclass(frozen=True)
class HubSettings:
    endpoint: str = ""  # "" = huggingface_hub's own: HF_ENDPOINT, else https://huggingface.co
    token_file: Path | None = None  # None = huggingface_hub's own: HF_TOKEN, else its token file


def parse_hf(name: str, source: str) -> tuple[str, str]:
    """(repo id, revision) of ``hf://ORG/REPO[@REVISION]`` (revision "main" when none); InvalidAdapter
    when malformed."""
    rest = source.removeprefix("hf://")
    repo, at, revision = rest.partition("@")
    repo = repo.strip("/")
    if not _REPO.match(repo) or (at and not _REVISION.match(revision)) or ".." in repo + revision:
        raise InvalidAdapter(f"adapter {name!r}: {source!r} is not hf://ORG/REPO or hf://ORG/REPO@REVISION "
                             "(a branch, tag or commit)")
    return repo, revision or "main"


class HubSource:
    def __init__(self, settings: HubSettings, max_bytes: int, timeout_s: float) -> None:
        self.settings = settings
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def fetch(self, name: str, source: str, staging: Path) -> str:
        """Downloads both files at the revision's commit into ``staging``; returns "commit <sha>"."""
        from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

        repo, revision = parse_hf(name, source)
        token = self._token(name)
        endpoint = self.settings.endpoint or None
        shown = f"hf://{repo}@{revision}"
        try:
            api = HfApi(endpoint=endpoint, token=token)
            commit = api.model_info(repo, revision=revision, timeout=self.timeout_s).sha
            if not commit:
                raise SourceUnavailable(f"adapter {name!r}: the Hub named no commit for {shown}")
            size = get_hf_file_metadata(hf_hub_url(repo, WEIGHTS_FILE, revision=commit, endpoint=endpoint),
                                        token=token, timeout=self.timeout_s, endpoint=endpoint).size
            if size is not None and size > self.max_bytes:
                raise InvalidAdapter(f"adapter {name!r}: {WEIGHTS_FILE} of {shown} is {size} bytes, over the pod's "
                                     f"limit of {self.max_bytes} (--max-adapter-bytes)")
            hub_dir = staging / "hub"
            for filename in (CONFIG_FILE, WEIGHTS_FILE):
                path = hf_hub_download(repo, filename, revision=commit, local_dir=hub_dir,
                                       cache_dir=staging / "hub-cache", token=token, endpoint=endpoint,
                                       etag_timeout=self.timeout_s)
                shutil.move(path, staging / filename)
        except (SourceUnavailable, InvalidAdapter):
            raise
        except Exception as e:
            raise _hub_error(name, shown, e) from None
        finally:
            for leftover in ("hub", "hub-cache"):
                shutil.rmtree(staging / leftover, ignore_errors=True)
        return f"commit {commit}"

    def _token(self, name: str) -> str | None:
        if self.settings.token_file is None:
            return None
        try:
            return self.settings.token_file.read_text().strip() or None
        except OSError as e:
            raise SourceDenied(f"adapter {name!r}: cannot read the Hub token file {self.settings.token_file} "
                               f"(--hf-token-file): {e.strerror}") from None


def _hub_error(name: str, shown: str, e: Exception) -> Exception:
    """The domain error for what huggingface_hub raised; never its message, which may quote URLs and bodies."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    response = getattr(e, "response", None)
    status = getattr(response, "status_code", 0) if isinstance(e, HfHubHTTPError) else 0
    if isinstance(e, GatedRepoError) or status in (401, 403):
        return SourceDenied(f"adapter {name!r}: the Hub refused this pod access to {shown} (HTTP {status}); give "
                            "the pod a token that can read the repository (--hf-token-file or HF_TOKEN)")
    if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError)):
        return AdapterNotFound(f"adapter {name!r}: the Hub has no {shown} (repository or revision not found; a "
                               "private repository also needs a token)")
    if isinstance(e, EntryNotFoundError) and status == 404:
        return AdapterNotFound(f"adapter {name!r}: {shown} holds no {CONFIG_FILE} and {WEIGHTS_FILE} at its root")
    if status and status != 429 and status < 500:
        return InvalidAdapter(f"adapter {name!r}: the Hub answered HTTP {status} for {shown}")
    return SourceUnavailable(f"adapter {name!r}: downloading {shown} from the Hub failed "
                             f"({type(e).__name__}{f', HTTP {status}' if status else ''}); retry later")
