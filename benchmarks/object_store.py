"""An S3-compatible store on loopback for the tests and benchmarks: moto's server mode (``python -m
moto.server``), a real S3 API over HTTP with IAM users, keys and policies.

``start`` sets it up without authentication (a bucket, a reader with a key that may get objects of that
bucket, a user with a key and no policy), then turns authentication on: from then on every request
must be signed by a key the store knows, with a policy that allows it, as on AWS.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.processes import free_port
from cli.up.child_process import spawn, stop_process, tail, wait_listening

REGION = "us-east-1"


@dataclass(frozen=True)
class Key:
    access_key_id: str
    secret_access_key: str

    def env(self, endpoint: str) -> dict[str, str]:
        """The standard AWS variables a pod (or any AWS tool) reads, for this key at ``endpoint``."""
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key, "AWS_DEFAULT_REGION": REGION}


class MotoS3:
    def __init__(self, workdir: Path, bucket: str = "adapters") -> None:
        self.workdir, self.bucket = Path(workdir), bucket
        self.port = free_port()
        self.log = self.workdir / "moto.log"
        self.proc = None
        self.reader: Key | None = None  # may get objects of the bucket
        self.outsider: Key | None = None  # a valid key with no policy
        self._admin = Key("admin-setup", "admin-setup")  # accepted only before authentication is on

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> MotoS3:
        self.proc = spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], self.log)
        wait_listening("127.0.0.1", self.port, self.proc, timeout_s, what="moto server",
                       log_tail=lambda: tail(self.log))
        iam = self.client("iam", self._admin)
        self.client("s3", self._admin).create_bucket(Bucket=self.bucket)
        policy = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
             "Resource": f"arn:aws:s3:::{self.bucket}/*"}]}
        for user in ("reader", "outsider"):
            iam.create_user(UserName=user)
            made = iam.create_access_key(UserName=user)["AccessKey"]
            key = Key(made["AccessKeyId"], made["SecretAccessKey"])
            if user == "reader":
                iam.put_user_policy(UserName=user, PolicyName="adapters", PolicyDocument=json.dumps(policy))
                self.reader = key
            else:
                self.outsider = key
        # Authentication on: every request from now is checked against IAM.
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        return self

    def client(self, service: str = "s3", key: Key | None = None):
        import boto3

        key = key or self.reader
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=key.access_key_id, aws_secret_access_key=key.secret_access_key)

    def put_adapter(self, prefix: str, adapter_dir: Path, weights: bytes | None = None) -> str:
        """Uploads a PEFT directory under ``prefix`` (``weights`` replaces its weights file); returns its s3:// URL."""
        s3 = self.client()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            body = weights if weights is not None and f.endswith(".safetensors") else (adapter_dir / f).read_bytes()
            s3.put_object(Bucket=self.bucket, Key=f"{prefix}/{f}", Body=body)
        return f"s3://{self.bucket}/{prefix}"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)
