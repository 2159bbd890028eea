"""CurveZMQ for every pdserve link (router <-> node control, node <-> node KV side channel).

A cluster shares one CURVE key pair made by `pdserve keygen DIR`
(DIR/cluster.key and DIR/cluster.key_secret, pyzmq's certificate format). With `--curve-dir DIR`
every server socket (the router's control socket, a decode node's KV receiver) runs as a CURVE
server whose ZAP handler admits only clients presenting a public key found in DIR, and every
client socket connects with the pair: a peer without the secret key cannot complete the
handshake, so none of its messages ever reaches pdserve code. Traffic is encrypted as well.
The nccl connector's tensor payloads travel over torch.distributed, which CURVE cannot cover;
use `zmq` or `shm` where links must be authenticated end to end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.asyncio
import zmq.auth

KEY_NAME = "cluster"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The cluster's key pair and the directory of public keys a server admits."""

    public: bytes
    secret: bytes
    directory: str

    @classmethod
    def load(cls, directory: str) -> CurveKeys:
        path = os.path.join(directory, f"{KEY_NAME}.key_secret")
        if not os.path.exists(path):
            raise ValueError(f"no {path}: make one with `pdserve keygen DIR`")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"{path} holds no secret key")
        return cls(public, secret, directory)

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (before bind) a CURVE server with the cluster's secret key."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make `sock` (before connect) a CURVE client of a cluster server."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public


_AUTHENTICATORS: dict[int, object] = {}


def admit_cluster_keys(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler that lets in only clients with a public key
    from keys.directory. Without it a CURVE server would admit any client key. Call
    `stop_admitting(ctx)` before terminating the context."""
    if id(ctx) in _AUTHENTICATORS:
        return
    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.directory)
    _AUTHENTICATORS[id(ctx)] = auth


def stop_admitting(ctx: zmq.Context) -> None:
    auth = _AUTHENTICATORS.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def load_keys(directory: str | None) -> CurveKeys | None:
    return CurveKeys.load(directory) if directory else None


def keygen(directory: str) -> tuple[str, str]:
    """Write DIR/cluster.key and DIR/cluster.key_secret (owner-only); their paths."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, KEY_NAME)
    os.chmod(secret, 0o600)
    return public, secret
