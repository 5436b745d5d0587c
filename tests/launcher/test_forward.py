"""The SSH port-forward of `fab tensorboard` (clipforge.launcher.connection.forward_local), through
the real sshd of the launcher tests."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from fabric import Config

from clipforge.launcher.connection import HostSpec, connect, forward_local
from tests.support.sshd import free_port
from tests.support.wait import wait_for


class _Server:
    """The far end on 127.0.0.1 (a TensorBoard stand-in): one connection, with events for its
    first bytes and its end."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.got_bytes, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            while conn.recv(1024):
                self.got_bytes.set()
            self.ended.set()


def _connected(port: int) -> socket.socket | None:
    """A connection to the forward's local end; None until Fabric's thread listens there."""
    try:
        return socket.create_connection(("127.0.0.1", port))
    except ConnectionRefusedError:
        return None


@pytest.fixture
def cxn(sshd):
    spec = HostSpec(host=sshd.host, user=sshd.user, port=sshd.port, pinned_key=sshd.host_public_key)
    config = Config(overrides={"connect_kwargs": {"key_filename": [str(sshd.client_key)]}})
    connection = connect(spec, config, accept_new_host_key=False)
    yield connection
    connection.close()


def _reset_through(local_port: int, server: _Server) -> None:
    """A client that sends through the forward, then resets its connection (a browser dropping
    a response), and the tunnel thread that met the reset gone."""
    client = wait_for(lambda: _connected(local_port), what="the forward listening")
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert server.got_bytes.wait(60), "nothing came through the forward"
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # with linger 0: a reset, not a close
    assert server.ended.wait(60), "the tunnel outlived the reset"  # its thread met it


def test_a_client_that_resets_its_connection_ends_the_forward_quietly(cxn):
    """Leaving the forward (Ctrl-C on `fab tensorboard`) after a browser reset a connection
    raises nothing, where Fabric raised the reset as a ThreadException."""
    server, local_port = _Server(), free_port()
    with forward_local(cxn, local_port, server.port):
        _reset_through(local_port, server)


def test_an_error_inside_the_forward_is_raised_not_hidden_by_a_reset(cxn):
    server, local_port = _Server(), free_port()
    with pytest.raises(KeyError, match="inside"), forward_local(cxn, local_port, server.port):
        _reset_through(local_port, server)
        raise KeyError("inside")
