"""The gloo control group across nodes: which address it binds to, and a refusal at start when it cannot connect.

gloo does not search for a usable interface as NCCL does. Unless ``GLOO_SOCKET_IFNAME`` names one, it binds to
the first address the machine's host name resolves to (torch's ``ProcessGroupGloo::createDefaultDevice``; if the
name does not resolve, to loopback). On many clusters the host name maps to ``127.0.1.1`` in ``/etc/hosts``, or to
a management NIC the other nodes cannot reach: then ``new_group(backend="gloo")`` fails ("Gloo connectFullMesh
failed") or hangs, while the NCCL group of the same run would have found its interface.

:func:`control_group` therefore first exchanges each rank's host name and bind address through the rendezvous
store (which works, since the run got this far), refuses a multi-node run in which some rank would bind to
loopback (every rank raises the same ``ValueError``, naming the ranks, the addresses, the variable and the fix),
and turns a failure to create or connect the group into an error that says the same.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
from datetime import timedelta
from typing import Any, Sequence

from distperp_harness.distributed.store import default_store
from distperp_harness.errors import InputError

VARIABLE = "GLOO_SOCKET_IFNAME"
_HOW_TO_FIX = (
    f"Fix: set {VARIABLE}=<interface> on every node, the interface through which the nodes reach each "
    f"other (usually the same as NCCL_SOCKET_IFNAME; `ip -brief addr` lists the interfaces, pick the one "
    f"holding the address the other nodes use for this node, e.g. the one MASTER_ADDR belongs to on the "
    f"main node), or make the host name resolve to that address (/etc/hosts)."
)


def bound_address() -> tuple[str, str]:
    """``(address, how it was chosen)``: the address gloo's default device binds to in this process.

    ``DISTPERP_TEST_GLOO_ADDRESS`` replaces the address (tests fake a loopback bind with it).
    """
    fake = os.environ.get("DISTPERP_TEST_GLOO_ADDRESS")
    if fake:
        return fake, "DISTPERP_TEST_GLOO_ADDRESS (a test's fake)"
    names = os.environ.get(VARIABLE)
    if names:
        first = names.split(",")[0].strip()
        try:
            import psutil

            addrs = psutil.net_if_addrs().get(first, [])
        except ImportError:  # pragma: no cover - psutil ships with accelerate
            addrs = []
        found = [a.address for a in addrs if a.family == socket.AF_INET] + [
            a.address.split("%")[0] for a in addrs if a.family == socket.AF_INET6
        ]
        return (str(found[0]) if found else "unknown"), f"{VARIABLE}={names}"
    host = socket.gethostname()
    try:
        return str(
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        ), f"host name {host!r} resolves to it ({VARIABLE} unset)"
    except OSError:
        return "127.0.0.1", f"host name {host!r} does not resolve, gloo falls back to loopback ({VARIABLE} unset)"


def host_name() -> str:
    return os.environ.get("DISTPERP_TEST_HOSTNAME") or socket.gethostname()


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def binding_problem(entries: Sequence[tuple[str, str, str]]) -> str | None:
    """Why the control group cannot connect, or None. ``entries[r]``: rank ``r``'s ``(host, address, how)``.

    A run whose ranks live on more than one host must not bind any rank to a loopback address: the other hosts
    cannot reach it. (On one host, loopback is fine.)
    """
    if len({host for host, _, _ in entries}) < 2:
        return None
    bad = [(r, host, addr, how) for r, (host, addr, how) in enumerate(entries) if is_loopback(addr)]
    if not bad:
        return None
    shown = "; ".join(f"rank {r} on {host} binds to {addr} ({how})" for r, host, addr, how in bad[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    return (
        f"the gloo control plane (distperp's own exchanges, on CPU and GPU runs alike) cannot connect across "
        f"the {len({h for h, _, _ in entries})} nodes of this run: {shown}{more}, a loopback address the "
        f"other nodes cannot reach. {_HOW_TO_FIX}"
    )


def exchange(store: Any, rank: int, world_size: int, value: Any, key: str = "distperp/controlplane") -> list[Any]:
    """Every rank's ``value`` through the rendezvous store (no process group needed); blocks up to the store's
    timeout for the others."""
    store.set(f"{key}/rank{rank}", pickle.dumps(value))
    return [pickle.loads(store.get(f"{key}/rank{r}")) for r in range(world_size)]


def control_group(rank: int, world_size: int, timeout_s: float) -> Any:
    """The gloo control group of the run (every rank calls this together), after :func:`binding_problem`
    found nothing; a failure to create it names this rank's bind address and the fix."""
    import torch.distributed as dist

    address, how = bound_address()
    store = default_store()
    if store is not None:
        problem = binding_problem(exchange(store, rank, world_size, (host_name(), address, how)))
        if problem:
            raise InputError(problem, same_on_every_rank=True)
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo raises RuntimeError/DistBackendError variants
        raise RuntimeError(
            f"distperp: rank {rank} could not create or connect the gloo control group (bound to {address}: {how}); "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. If the nodes cannot reach "
            f"that address: {_HOW_TO_FIX}"
        ) from exc
