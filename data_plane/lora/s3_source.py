"""Adapters in S3 or an S3-compatible store: ``s3://BUCKET/PREFIX/`` holds ``PREFIX/adapter_config.json``
and ``PREFIX/adapter_model.safetensors``.

boto3 does the talking: it is AWS's own client, signs requests for every S3-compatible store
(MinIO, Ceph, R2, GCS interoperability), and finds credentials the way every AWS tool does: the
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` variables, a shared credentials file
(``AWS_SHARED_CREDENTIALS_FILE``), the pod's service account (IRSA's ``AWS_WEB_IDENTITY_TOKEN_FILE``,
EKS Pod Identity) or the node's instance profile. ``AWS_ENDPOINT_URL`` and ``AWS_DEFAULT_REGION`` work
as they do for the AWS CLI; --s3-endpoint-url and --s3-region override them. A store other than AWS
is addressed path-style (``ENDPOINT/BUCKET/KEY``), which every compatible store understands.

No message built here quotes the store's answer or the credentials: a denied request says which
object and which error code, never the key id that was refused.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from data_plane.errors import AdapterNotFound, InvalidAdapter, SourceDenied, SourceUnavailable
from data_plane.lora.disk_tier import CONFIG_FILE, WEIGHTS_FILE

_CHUNK = 1 << 20
_MAX_CONFIG_BYTES = 1 << 20
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "AllAccessDisabled", "AccountProblem", "403", "401"}
ADDRESSING_STYLES = ("auto", "path", "virtual")


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str = ""  # "" = boto3's own: AWS_ENDPOINT_URL, else AWS
    region: str = ""  # "" = boto3's own: AWS_DEFAULT_REGION / AWS_REGION / the profile's
    addressing_style: str = "auto"  # auto = path-style for any endpoint but AWS's, virtual-hosted on AWS

    def __post_init__(self) -> None:
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(f"--s3-addressing-style must be one of {', '.join(ADDRESSING_STYLES)}, "
                             f"not {self.addressing_style!r}")
        if self.endpoint_url and urlparse(self.endpoint_url).scheme not in ("http", "https"):
            raise ValueError(f"--s3-endpoint-url {self.endpoint_url!r} must be an http(s):// URL")


def parse_s3(name: str, source: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes) of ``s3://BUCKET/PREFIX``; InvalidAdapter when malformed."""
    url = urlparse(source)
    if url.username or url.password or "@" in url.netloc:
        raise InvalidAdapter(f"adapter {name!r}: an s3:// source must not carry credentials; give the pod "
                             "credentials through its environment or service account")
    if url.query or url.fragment or not _BUCKET.match(url.netloc):
        raise InvalidAdapter(f"adapter {name!r}: {source!r} is not s3://BUCKET/PREFIX with a valid bucket name "
                             "(3-63 lower-case letters, digits, dots and hyphens)")
    return url.netloc, url.path.strip("/")


class S3Source:
    """Fetches s3:// adapter sources with one boto3 client, made on first use (finding credentials may
    take a network round trip). Thread-safe: boto3 clients are."""

    def __init__(self, settings: S3Settings, max_bytes: int, timeout_s: float) -> None:
        self.settings = settings
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._client = None
        self._guard = threading.Lock()

    def fetch(self, name: str, source: str, staging: Path) -> str:
        """Downloads both objects into ``staging``; returns the weights object's ETag (recorded with the copy)."""
        bucket, prefix = parse_s3(name, source)
        client = self._s3()
        self._get(client, name, bucket, _key(prefix, CONFIG_FILE), staging / CONFIG_FILE,
                  min(self.max_bytes, _MAX_CONFIG_BYTES))
        return self._get(client, name, bucket, _key(prefix, WEIGHTS_FILE), staging / WEIGHTS_FILE, self.max_bytes)

    def _s3(self):
        with self._guard:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self):
        import boto3
        from botocore.config import Config

        def client(style: str):
            config = Config(connect_timeout=self.timeout_s, read_timeout=self.timeout_s,
                            retries={"mode": "standard", "max_attempts": 3}, s3={"addressing_style": style})
            return boto3.session.Session().client("s3", endpoint_url=self.settings.endpoint_url or None,
                                                  region_name=self.settings.region or None, config=config)

        style = self.settings.addressing_style
        made = client("virtual" if style == "auto" else style)
        if style == "auto" and not urlparse(made.meta.endpoint_url).hostname.endswith(".amazonaws.com"):
            made = client("path")  # a compatible store: buckets as host names would need its DNS to know them
        return made

    def _get(self, client, name: str, bucket: str, key: str, dest: Path, limit: int) -> str:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

        shown = f"s3://{bucket}/{key}"
        received = 0
        try:
            obj = client.get_object(Bucket=bucket, Key=key)
            body = obj["Body"]
            with body, open(dest, "wb") as out:
                if obj.get("ContentLength", 0) > limit:
                    raise InvalidAdapter(f"adapter {name!r}: {shown} is {obj['ContentLength']} bytes, over the "
                                         f"pod's limit of {limit} (--max-adapter-bytes)")
                for chunk in body.iter_chunks(_CHUNK):
                    received += len(chunk)
                    out.write(chunk)
            return str(obj.get("ETag", "")).strip('"')
        except ClientError as e:
            raise _client_error(name, shown, e) from None
        except (NoCredentialsError, PartialCredentialsError):
            raise SourceDenied(f"adapter {name!r}: no S3 credentials to read {shown}: give the pod "
                               "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a credentials file "
                               "(AWS_SHARED_CREDENTIALS_FILE) or a service account with access") from None
        except BotoCoreError as e:  # no connection, a timeout, a body cut short
            raise SourceUnavailable(f"adapter {name!r}: reading {shown} failed after {received} bytes "
                                    f"({type(e).__name__}); the store did not answer in full, retry later") from None
        except OSError as e:
            raise SourceUnavailable(f"adapter {name!r}: reading {shown} failed after {received} bytes: "
                                    f"{e.strerror or type(e).__name__}") from None


def _key(prefix: str, filename: str) -> str:
    return f"{prefix}/{filename}" if prefix else filename


def _client_error(name: str, shown: str, e) -> Exception:
    error = e.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    if code in _NOT_FOUND or status == 404:
        return AdapterNotFound(f"adapter {name!r}: {shown} does not exist ({code or status}); the source must be "
                               f"the prefix holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    if code in _DENIED or status in (401, 403):
        return SourceDenied(f"adapter {name!r}: the store refused to let this pod read {shown} ({code or status}); "
                            "check the pod's S3 credentials and the bucket's policy")
    if status == 429 or status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
        return SourceUnavailable(f"adapter {name!r}: the store failed to serve {shown} ({code or status}); "
                                 "retry later")
    return InvalidAdapter(f"adapter {name!r}: the store refused the request for {shown} ({code or status})")
