"""Bearer-token authentication of the control plane's own services."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from conventions.errors import ConfigError

PROTECTED_PREFIXES = ("/lorafleet.v1.AdapterAdmin/", "/lorafleet.v1.PodMembership/")


def read_token(path: Path) -> str:
    """The token in ``path``, stripped of surrounding whitespace."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the admin token file {path}: {e.strerror}") from e
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"the admin token file {path} must hold one token: non-empty, without spaces")
    return token


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call to a protected service through only with ``authorization: Bearer <token>``.
    Health and reflection stay open so that probes and grpcurl work without the token.
    Serves both processes: the control plane's admin services and the pods' DataPlaneAdmin."""

    def __init__(self, token: str, protected: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        self._expected = token.encode()
        self._protected = protected

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self._protected):
            problem = self._problem(dict(handler_call_details.invocation_metadata or ()).get("authorization"))
            if problem:
                return _deny(problem)
        return await continuation(handler_call_details)

    def _problem(self, header: str | None) -> str:
        if not header:
            return "missing credentials: send the metadata 'authorization: Bearer <token>'"
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return "malformed credentials: the authorization metadata must read 'Bearer <token>'"
        # Constant-time comparison, so that response timing does not reveal a token prefix.
        if not hmac.compare_digest(presented.strip().encode(), self._expected):
            return "wrong bearer token: use the token from the control plane's --admin-token-file"
        return ""


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # Every protected RPC is unary-unary; the request is left undecoded since it is refused.
    return grpc.unary_unary_rpc_method_handler(deny)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``, for clients of protected services."""
    return (("authorization", f"Bearer {token}"),)
