"""Bearer-token authentication between components: which role's token each protected method accepts."""

from __future__ import annotations

import enum
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


class Role(enum.Enum):
    """Who holds a credential between components (docs/SECURITY.md): ``ADMIN`` writes the registry
    (register, pin, unpin, unregister) and reads it; ``READER`` (routers, dashboards) only reads it and
    pods' state; ``POD`` is the control plane and its pods between them: DataPlaneAdmin on the pods,
    PodMembership on the control plane."""

    ADMIN = "admin"
    READER = "reader"
    POD = "pod"


# (method or service prefix, roles it accepts): the first prefix that matches a call decides.
Grants = tuple[tuple[str, frozenset[Role]], ...]
_ADMIN_READS = ("GetAdapter", "ListAdapters", "ListPods", "Route")
CONTROL_PLANE_GRANTS: Grants = (
    *((f"/lorafleet.v1.AdapterAdmin/{m}", frozenset({Role.ADMIN, Role.READER})) for m in _ADMIN_READS),
    ("/lorafleet.v1.AdapterAdmin/", frozenset({Role.ADMIN})),
    ("/lorafleet.v1.PodMembership/", frozenset({Role.POD})),
)
POD_GRANTS: Grants = (
    ("/lorafleet.v1.DataPlaneAdmin/GetState", frozenset({Role.POD, Role.READER})),
    ("/lorafleet.v1.DataPlaneAdmin/", frozenset({Role.POD})),
)


class RoleAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call to a granted method through only with ``authorization: Bearer <token>`` of a role the
    method accepts: no or an unknown token is UNAUTHENTICATED, a known token of another role
    PERMISSION_DENIED. ``tokens`` maps each role to its token; one token may serve several roles (a
    single shared token, as before roles existed). Methods no grant names (health, reflection) stay open
    so that probes and grpcurl work without a token."""

    def __init__(self, tokens: dict[Role, str], grants: Grants) -> None:
        self._tokens = [(role, token.encode()) for role, token in tokens.items()]
        self._grants = grants

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        accepted = next((roles for prefix, roles in self._grants if method.startswith(prefix)), None)
        if accepted is not None:
            header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
            code, problem = self._problem(header, accepted, method)
            if problem:
                return _deny(code, problem)
        return await continuation(handler_call_details)

    def _problem(self, header: str | None, accepted: frozenset[Role], method: str) -> tuple[grpc.StatusCode, str]:
        if not header:
            return _UNAUTH, "missing credentials: send the metadata 'authorization: Bearer <token>'"
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return _UNAUTH, "malformed credentials: the authorization metadata must read 'Bearer <token>'"
        # Every token compared, each in constant time, so that timing reveals neither a token nor its role.
        held = {role for role, token in self._tokens if hmac.compare_digest(presented.strip().encode(), token)}
        if not held:
            return _UNAUTH, "wrong bearer token: use the token of a role this server knows (docs/SECURITY.md)"
        if not held & accepted:
            needs = " or ".join(sorted(r.value for r in accepted))
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"this token ({', '.join(sorted(r.value for r in held))}) may not call {method}; it needs the"
                    f" {needs} token")
        return grpc.StatusCode.OK, ""


class BearerAuthInterceptor(RoleAuthInterceptor):
    """One token for every method under ``protected``: the control plane's services, or a pod's DataPlaneAdmin."""

    def __init__(self, token: str, protected: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        super().__init__({Role.ADMIN: token}, tuple((p, frozenset({Role.ADMIN})) for p in protected))


_UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(code, message)

    # Every protected RPC is unary-unary; the request is left undecoded since it is refused.
    return grpc.unary_unary_rpc_method_handler(deny)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``, for clients of protected services."""
    return (("authorization", f"Bearer {token}"),)
