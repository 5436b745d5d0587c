"""A real S3 API on this machine: moto's server (`moto[server]`) on 127.0.0.1, which s3fs reaches
as it reaches any S3 endpoint (AWS_ENDPOINT_URL, credentials from the environment).

Stopping it is a store gone down: clients get connection errors. Starting it again on the same
port brings the same buckets back (moto keeps them in this process), as a store that returns.
"""

from __future__ import annotations

import logging
import secrets

from moto.server import ThreadedMotoServer

# Credentials every client here uses; the secret must never appear in what a run writes.
ACCESS_KEY = "AKIACLIPFORGETEST"
SECRET_KEY = f"clipforge-test-secret-{secrets.token_hex(8)}"


class S3Server:
    def __init__(self, address: str = "127.0.0.1"):
        self.address = address
        self.port = 0
        self._server: ThreadedMotoServer | None = None
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    def start(self) -> S3Server:
        """Start it, on the port it had before if it ran already; running already: nothing."""
        if self._server is not None:
            return self
        self._server = ThreadedMotoServer(ip_address=self.address, port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the store: the standard variables of AWS's libraries."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self):
        """An s3fs client of this server, not shared with the code under test."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
        )

    def new_bucket(self) -> str:
        """A bucket of its own for one test; its URL."""
        name = f"runs-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return f"s3://{name}"


def unreachable_store(run_id: str):
    """A RunStore of `run_id` at an S3 endpoint where nothing answers (one try per request):
    a store that is down for the whole run."""
    import s3fs

    from clipforge.store.remote import RunStore
    from tests.support.sshd import free_port

    nowhere = s3fs.S3FileSystem(
        key="k",
        secret="s",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        retries=1,
        config_kwargs={"retries": {"max_attempts": 1}},
        skip_instance_cache=True,
    )
    return RunStore("s3://gone/runs", run_id, filesystem=(nowhere, "gone/runs"))
