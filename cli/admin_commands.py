"""``lorafleet adapters {register,pin,unpin,unregister,list}`` and ``lorafleet pods``: the control plane's
AdapterAdmin from the command line, printed as tables or, with ``--json``, as the API's own fields."""

from __future__ import annotations

import argparse
import json
import time

from conventions import defaults
from conventions.names import NAME_RULE


def add_parsers(sub: argparse._SubParsersAction) -> None:
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--control-plane", help=f"control plane host:port (env LORAFLEET_CONTROL_PLANE; "
                                              f"default {defaults.CONTROL_PLANE_ENDPOINT})")
    conn.add_argument("--tls-ca", help="PEM CA of the control plane's certificate: dial it over TLS (env "
                                       "LORAFLEET_TLS_CA; default: plaintext)")
    conn.add_argument("--tls-cert", help="PEM certificate to show a control plane that asks for one, i.e. mutual "
                                         "TLS; needs --tls-ca and --tls-key (env LORAFLEET_TLS_CERT; default: none)")
    conn.add_argument("--tls-key", help="PEM private key of --tls-cert (env LORAFLEET_TLS_KEY; default: none)")
    conn.add_argument("--token", help="admin bearer token (env LORAFLEET_TOKEN)")
    conn.add_argument("--token-file", help="file holding the admin token (env LORAFLEET_TOKEN_FILE; default: the "
                                           "file `lorafleet up` writes, $LORAFLEET_HOME/up/admin-token)")
    conn.add_argument("--json", action="store_true", help="print JSON instead of a table")

    adapters = sub.add_parser("adapters", help="register, pin, unpin, unregister and list adapters")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    reg = asub.add_parser("register", parents=[conn], help="register an adapter under a name")
    reg.add_argument("name", help=f"unique name: {NAME_RULE}")
    reg.add_argument("source", help="PEFT adapter directory under the pods' adapter roots (a path, or a file:// "
                                    "URL), or an http(s)://, s3://BUCKET/PREFIX or hf://ORG/REPO[@REVISION] URL")
    reg.add_argument("--sha256", help="SHA-256 of adapter_model.safetensors (computed for a local directory; "
                                      "required otherwise)")
    reg.add_argument("--base-model", help="base model id (default: the one the pods serve)")
    reg.add_argument("--pin", action="store_true", help="pin it as well, on --replicas pods")
    reg.add_argument("--replicas", type=int, default=0, help="pods to pin it on with --pin (0 = every pod)")
    reg.set_defaults(func=_register)
    pin = asub.add_parser("pin", parents=[conn], help="keep an adapter loaded on pods")
    pin.add_argument("name")
    pin.add_argument("--replicas", type=int, default=0, help="pods to pin it on (0 = every pod)")
    pin.set_defaults(func=_pin)
    for name, func, text in (("unpin", _unpin, "remove an adapter's pin (pods keep it cached until evicted)"),
                             ("unregister", _unregister, "remove an adapter from the registry and every pod")):
        p = asub.add_parser(name, parents=[conn], help=text)
        p.add_argument("name")
        p.set_defaults(func=func)
    ls = asub.add_parser("list", parents=[conn], help="every adapter with its placements")
    ls.set_defaults(func=_list)

    pods = sub.add_parser("pods", parents=[conn], help="the data-plane pods the control plane knows of")
    pods.set_defaults(func=_pods)


def _client(args: argparse.Namespace):
    from cli.admin_client import AdminClient, control_plane_dialer, control_plane_target, resolve_token

    return AdminClient(control_plane_target(args.control_plane), resolve_token(args.token, args.token_file),
                       dialer=control_plane_dialer(args.tls_ca, args.tls_cert, args.tls_key))


def _register(args: argparse.Namespace) -> int:
    from cli.admin_client import registration_source

    source, sha256 = registration_source(args.source, args.sha256)
    with _client(args) as admin:
        adapter = admin.register(args.name, source, sha256, args.base_model or admin.fleet_base_model())
        if args.pin:
            adapter = admin.pin(args.name, args.replicas)
    _print_adapters([adapter], args.json)
    return 0


def _pin(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        _print_adapters([admin.pin(args.name, args.replicas)], args.json)
    return 0


def _unpin(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        _print_adapters([admin.unpin(args.name)], args.json)
    return 0


def _unregister(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        admin.unregister(args.name)
    print(json.dumps({"unregistered": args.name}) if args.json else f"unregistered {args.name}")
    return 0


def _list(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        _print_adapters(admin.adapters(), args.json)
    return 0


def _pods(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        pods = admin.pods()
    if args.json:
        print(json.dumps([_as_dict(p) for p in pods], indent=2))
        return 0
    now = time.time()
    rows = [(p.id, p.endpoint, "yes" if p.ready else "no", p.base_model, p.precision or "-",
             f"{p.slots_used}/{p.slots_total} ({p.slots_pinned} pinned)", f"{p.cpu_cache_used}/{p.cpu_cache_capacity}",
             f"{p.running_requests}/{p.waiting_requests}", f"{max(0.0, now - p.last_heartbeat):.1f}s ago",
             ",".join(f"{a}*" if a in p.pinned_adapters else a for a in p.adapters) or "-")
            for p in pods]
    print(table(("POD", "ENDPOINT", "READY", "BASE MODEL", "PRECISION", "SLOTS", "CPU CACHE", "RUN/WAIT", "HEARTBEAT",
                 "ADAPTERS (* pinned)"), rows, empty="no pods"))
    return 0


def _print_adapters(adapters: list, as_json: bool) -> None:
    from lorafleet.v1 import adapter_admin_pb2 as pb

    if as_json:
        print(json.dumps([_as_dict(a) for a in adapters], indent=2))
        return
    rows = []
    for a in adapters:
        pinned = ("every pod" if a.pin_replicas == 0 else f"{a.pin_replicas} pods") if a.pinned else "no"
        placements = ", ".join(f"{p.pod}:{pb.PlacementState.Name(p.state)}{'*' if p.pinned else ''}"
                               + (f" ({p.error})" if p.error else "") for p in a.placements) or "-"
        rows.append((a.name, pinned, str(a.rank or "-"), a.base_model, a.sha256[:12], str(a.version),
                     placements + (f"  [{a.pin_status}]" if a.pin_status else "")))
    print(table(("NAME", "PINNED", "RANK", "BASE MODEL", "SHA256", "VERSION", "PLACEMENTS (* pinned)"), rows,
                empty="no adapters registered"))


def _as_dict(message) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]], empty: str) -> str:
    """Left-aligned columns, two spaces apart; ``empty`` when there are no rows."""
    if not rows:
        return empty
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))
